"""The `[dataset]` section, and the error of a dataset setting that cannot work."""

from __future__ import annotations

from dataclasses import dataclass

from core.config import ConfigError


@dataclass
class DatasetSection:
    """Where training text comes from."""

    name: str = "pydoc"
    """Built-in corpus shipped with the repo (pydoc), or a Hugging Face hub dataset name."""
    path: str = ""
    """Local json/jsonl/parquet/txt file or directory; overrides name when set."""
    split: str = "train"
    """Dataset split to read."""
    streaming: bool = True
    """Stream the dataset instead of downloading and materialising it first."""
    text_field: str = "text"
    """Name of the column that holds the raw text."""
    allow_download: bool = False
    """Let a Hugging Face dataset name be fetched from the Hub. false: Hugging Face runs offline (the shipped
    corpus, local files and datasets already in the local HF cache); an exported HF_HUB_OFFLINE=1 keeps a run
    offline even when true."""
    pretokenized: str = ""
    """A folder written by `python -m trainer.pretokenize` for this config: training and validation then read its
    token files, each rank only its own sequences, instead of tokenizing the documents. Empty: tokenize as they are
    read."""

    def check(self) -> list[ConfigError]:
        """Settings of this section that contradict each other."""
        if not self.name and not self.path:
            return [ConfigError("name", "empty and dataset.path is empty too", "a dataset name or a dataset.path")]
        return []


class DatasetError(ValueError):
    """A dataset setting that cannot work, found before training: the trainer reports it as a config error.

    ``key`` is the attribute of the dataset config at fault (``name``, ``path``, ``split``, ``text_field``),
    ``problem`` says what is wrong and ``allowed`` (optional) what would work instead.
    """

    def __init__(self, key: str, problem: str, allowed: str | None = None) -> None:
        super().__init__(problem)
        self.key = key
        self.problem = problem
        self.allowed = allowed
        self.where: str | None = None
        """Set by the trainer for an error found while training: the step, the rank and the loader."""
        self.config_key: str | None = None
        """Set by the trainer: the config key behind ``key`` (``dataset.*`` or ``validation.*``)."""
