"""The EAGLE-style drafter: model and distillation."""

from lsreplay.drafter.model import Drafter

__all__ = ["Drafter"]
