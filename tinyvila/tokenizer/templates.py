"""VILA chat templates, `<image>` expansion and id-level prompts.

Templates follow VILA's `llava/conversation.py` (`Template.render` is `get_prompt`), and the image
sentinel expansion follows VILA's `tokenizer_image_token`. `turn_ids` and `conversation_ids` build
the ids a KV cache holds turn by turn, so a cache built incrementally equals the whole prompt.
Tests: tests/test_templates.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import IMAGE_TOKEN, Tokenizer

IMAGE_PLACEHOLDER = "<image>"


# ----------------------------------------------------------------------------------------------
# Chat templates (VILA llava/conversation.py, VILA1.5 era)


@dataclass(frozen=True)
class Template:
    """One of VILA's conversation templates; `render` is VILA's `Conversation.get_prompt()`.

    style: "two" (vicuna: `role: text` + alternating sep/sep2), "llama_3" (role headers, sep after
    each message, sep2 after the last filled one), "mpt" (ChatML: role + text + sep).
    `answer_end` is what follows a finished answer in the history; `bos` the BOS string the
    template's tokenizer adds (None: no BOS); `special_tokens` the strings a tokenizer must treat
    as special for this template.
    """

    name: str
    system: str
    roles: tuple[str, str]
    style: str
    sep: str
    sep2: str | None
    stop_strings: tuple[str, ...]
    special_tokens: tuple[str, ...]
    bos: str | None

    @property
    def answer_end(self) -> str:
        return self.sep2 if self.style == "two" else self.sep

    def render(self, turns: list[tuple[str, str | None]], system: str | None = None) -> str:
        """Prompt string for [(user_text, assistant_text or None)], exactly as get_prompt()."""
        messages = [(role, m) for u, a in turns for role, m in zip(self.roles, (u, a))]
        system = self.system if system is None else system
        ret = system + self.sep
        for i, (role, msg) in enumerate(messages):
            ret += self._message(i, role, msg, last=i == len(messages) - 1)
        return ret

    def _message(self, i: int, role: str, msg: str | None, last: bool) -> str:
        if self.style == "two":
            return role + ": " + msg + (self.sep, self.sep2)[i % 2] if msg else role + ":"
        if self.style == "llama_3":
            return role + msg + (self.sep2 if last else self.sep) if msg else role
        return role + msg + self.sep if msg else role

    def turn_text(self, user_text: str, first: bool, system: str | None = None) -> str:
        """The prompt text of one user turn up to the assistant header (system included if first)."""
        head = ((self.system if system is None else system) + self.sep) if first else ""
        return head + self._message(0, self.roles[0], user_text, last=False) + self._message(1, self.roles[1], None, True)


_LLAMA3_SYSTEM = (
    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are a helpful language and vision "
    "assistant. You are able to understand the visual content that the user provides, and assist the user "
    "with a variety of tasks using natural language."
)

TEMPLATES: dict[str, Template] = {
    "llama_3": Template(
        name="llama_3", system=_LLAMA3_SYSTEM,
        roles=("<|start_header_id|>user<|end_header_id|>\n\n", "<|start_header_id|>assistant<|end_header_id|>\n\n"),
        style="llama_3", sep="<|eot_id|>", sep2="<|end_of_text|>",
        stop_strings=("<|eot_id|>", "<|end_of_text|>"),
        special_tokens=("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        bos="<|begin_of_text|>",
    ),
    "vicuna_v1": Template(
        name="vicuna_v1",
        system="A chat between a curious user and an artificial intelligence assistant. "
        "The assistant gives helpful, detailed, and polite answers to the user's questions.",
        roles=("USER", "ASSISTANT"), style="two", sep=" ", sep2="</s>",
        stop_strings=("</s>",), special_tokens=("<unk>", "<s>", "</s>"), bos="<s>",
    ),
    "hermes-2": Template(
        name="hermes-2", system="<|im_start|>system\nAnswer the questions.",
        roles=("<|im_start|>user\n", "<|im_start|>assistant\n"), style="mpt", sep="<|im_end|>", sep2=None,
        stop_strings=("<|im_end|>",), special_tokens=("<|im_start|>", "<|im_end|>"), bos=None,
    ),
    # ChatML as SmolLM2's embedded chat template writes it (newline after each <|im_end|>), with its
    # default system prompt. The newline leads the roles so that `answer_end` stays one token.
    "smollm2": Template(
        name="smollm2",
        system="<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face",
        roles=("\n<|im_start|>user\n", "\n<|im_start|>assistant\n"), style="mpt", sep="<|im_end|>", sep2=None,
        stop_strings=("<|im_end|>",), special_tokens=("<|im_start|>", "<|im_end|>"), bos=None,
    ),
}


def get_template(name: str) -> Template:
    """Template by name; a clear error listing the known ones otherwise."""
    if name not in TEMPLATES:
        raise ValueError(f"unknown chat template {name!r}; known: {sorted(TEMPLATES)}")
    return TEMPLATES[name]


def stop_ids(tokenizer: Tokenizer, template: Template) -> list[int]:
    """Ids of the template's stop strings that the tokenizer has as single tokens."""
    ids = [tokenizer.token_to_id(s) for s in template.stop_strings]
    return [i for i in ids if i is not None]


# ----------------------------------------------------------------------------------------------
# <image> expansion and id-level prompts


def expand_images(user_text: str, n_images: int) -> str:
    """VILA's rule: a message without `<image>` gets "<image>\\n" prepended once per image.

    A message that already holds placeholders is kept; their count must equal `n_images`.
    """
    count = user_text.count(IMAGE_PLACEHOLDER)
    if count == 0:
        return (IMAGE_PLACEHOLDER + "\n") * n_images + user_text
    if count != n_images:
        raise ValueError(f"user text holds {count} {IMAGE_PLACEHOLDER} placeholders but {n_images} images were given")
    return user_text


def _adds_bos(tokenizer: Tokenizer) -> bool:
    ids = tokenizer.encode("", add_special_tokens=True)
    return bool(ids) and ids[0] == tokenizer.bos_id


def tokenizer_image_token(tokenizer: Tokenizer, prompt: str) -> list[int]:
    """VILA's `tokenizer_image_token`: chunks between `<image>` tokenized with special tokens,
    one BOS kept (when chunk 0 starts with BOS, the first token of every chunk is dropped), chunks
    joined by IMAGE_TOKEN. Kept as the reference the segment-wise functions are tested against.
    """
    chunks = [tokenizer.encode(c, add_special_tokens=True) for c in prompt.split(IMAGE_PLACEHOLDER)]
    offset = 1 if chunks[0] and tokenizer.bos_id is not None and chunks[0][0] == tokenizer.bos_id else 0
    ids = [tokenizer.bos_id] if offset else []
    for k, chunk in enumerate(chunks):
        if k:
            ids.append(IMAGE_TOKEN)
        ids.extend(chunk[offset:])
    return ids


def _encode_after(tokenizer: Tokenizer, text: str, after: str | None) -> list[int]:
    """Ids of `text` as it tokenizes right after the special token `after` (sentencepiece puts
    no dummy prefix there); `after` itself is not returned."""
    if after is None or tokenizer.token_to_id(after) is None:
        return tokenizer.encode(text, add_special_tokens=False)
    lead = tokenizer.encode(after, add_special_tokens=False)
    return tokenizer.encode(after + text, add_special_tokens=False)[len(lead):] if text else []


def _segment_ids(tokenizer: Tokenizer, text: str, with_bos: bool, after: str | None) -> list[int]:
    chunks = text.split(IMAGE_PLACEHOLDER)
    ids = [tokenizer.bos_id] if with_bos and _adds_bos(tokenizer) else []
    for k, chunk in enumerate(chunks):
        if k:
            ids.append(IMAGE_TOKEN)
            ids.extend(tokenizer.encode(chunk, add_special_tokens=False))
        else:
            ids.extend(tokenizer.encode(chunk, add_special_tokens=False) if with_bos else _encode_after(tokenizer, chunk, after))
    return ids


def turn_ids(tokenizer: Tokenizer, template: Template, user_text: str, n_images: int, first: bool,
             prev_answer_ids: list[int] | None = None, system: str | None = None) -> list[int]:
    """Ids to append to the cache for one user turn, ending with the assistant header.

    The first turn carries BOS and the system prompt. A later turn starts with the template's
    answer-end token (`<|eot_id|>`, `</s>`, `<|im_end|>`) unless `prev_answer_ids` (all in the
    cache already) ends with it. Images become IMAGE_TOKEN sentinels (`expand_images`).
    """
    text = template.turn_text(expand_images(user_text, n_images), first, system)
    if first:
        return _segment_ids(tokenizer, text, True, None)
    end_id = tokenizer.token_to_id(template.answer_end)
    ids = [end_id] if end_id is not None and (not prev_answer_ids or prev_answer_ids[-1] != end_id) else []
    return ids + _segment_ids(tokenizer, text, False, template.answer_end)


def conversation_ids(tokenizer: Tokenizer, template: Template,
                     turns: list[tuple[str, int, list[int] | None]], system: str | None = None) -> list[int]:
    """Ids of a whole conversation: [(user_text, n_images, answer_ids or None)], only the last
    answer may be None. Defined as the concatenation of `turn_ids` and the answers, so a cache
    built turn by turn equals it at every turn.
    """
    ids: list[int] = []
    prev = None
    for k, (user_text, n_images, answer) in enumerate(turns):
        if prev is None and k > 0:
            raise ValueError(f"turn {k - 1} has no answer but is followed by another turn")
        ids += turn_ids(tokenizer, template, user_text, n_images, k == 0, prev, system)
        ids += list(answer or [])
        prev = answer
    return ids
