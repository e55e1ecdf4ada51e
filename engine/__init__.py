"""A lean speculative-decoding runtime for Kimi K2-family models."""

from engine.config import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    # NOTE: lazy so `import engine.config` does not pull in the models and torch.
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    raise AttributeError(name)
