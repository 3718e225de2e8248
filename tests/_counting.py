"""Test helpers shared by the HF-mapping tests."""

from collections import Counter
from collections.abc import Mapping


class CountingReads(Mapping):
    """A lazy-checkpoint stand-in: counts reads per key (Mapping's own `in` reads too)."""

    def __init__(self, sd: dict):
        self.sd, self.reads = sd, Counter()

    def __getitem__(self, key):
        value = self.sd[key]
        self.reads[key] += 1
        return value

    def __iter__(self):
        return iter(self.sd)

    def __len__(self):
        return len(self.sd)
