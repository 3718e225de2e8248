"""A sketch of a ROS 2 node around tinyvila.LiveSession, for rclpy users. NOT TESTED, and rclpy is NOT a dependency
of tinyvila: rclpy is not on PyPI, it comes with a ROS 2 install (`source /opt/ros/<distro>/setup.bash`). CI never
imports this file; adapt it to your robot.

    python -m scripts.ros2_node --ros-args -p model:=vila-8b-awq -p window:=8 -p sample_fps:=2.0

Subscribes `image` (sensor_msgs/Image, rgb8 or bgr8: pushed into the session, the newest wins while it is busy) and
`query` (std_msgs/String); publishes each answer on `answer` (std_msgs/String). Answers run on a worker thread so
the executor keeps taking frames while one streams; a question that comes while another is answered waits.
"""

import queue
import threading

import numpy as np
import rclpy
from rclpy.node import Node
from sensor_msgs.msg import Image
from std_msgs.msg import String

import tinyvila


class VilaNode(Node):
    def __init__(self):
        super().__init__("tinyvila")
        model = self.declare_parameter("model", "vila-8b-awq").value
        device = self.declare_parameter("device", "cuda").value
        window = self.declare_parameter("window", 8).value
        sample_fps = self.declare_parameter("sample_fps", 2.0).value
        self.live = tinyvila.LiveSession(tinyvila.load(model, device=device), window=window, sample_fps=sample_fps)
        self.questions: queue.Queue[str | None] = queue.Queue()
        self.pub = self.create_publisher(String, "answer", 10)
        self.create_subscription(Image, "image", self.on_image, 2)
        self.create_subscription(String, "query", lambda msg: self.questions.put(msg.data), 10)
        self.worker = threading.Thread(target=self.answer_loop, daemon=True)
        self.worker.start()

    def on_image(self, msg: Image) -> None:
        if msg.encoding not in ("rgb8", "bgr8"):
            self.get_logger().warning(f"image encoding {msg.encoding} is not rgb8/bgr8; frame skipped")
            return
        rows = np.frombuffer(msg.data, np.uint8).reshape(msg.height, msg.step)
        frame = rows[:, : msg.width * 3].reshape(msg.height, msg.width, 3)
        stamp = msg.header.stamp.sec + msg.header.stamp.nanosec * 1e-9
        self.live.push(frame, timestamp=stamp, bgr=msg.encoding == "bgr8")

    def answer_loop(self) -> None:
        while (question := self.questions.get()) is not None:
            try:
                self.live.wait_frames(1, timeout=10)
                self.pub.publish(String(data="".join(self.live.ask(question))))
            except tinyvila.TinyVilaError as e:
                self.get_logger().error(str(e))

    def destroy_node(self) -> None:
        self.questions.put(None)
        self.worker.join()
        self.live.close()
        super().destroy_node()


def main() -> None:
    rclpy.init()
    node = VilaNode()
    try:
        rclpy.spin(node)
    except KeyboardInterrupt:
        pass
    finally:
        node.destroy_node()
        rclpy.shutdown()


if __name__ == "__main__":
    main()
