"""ModelFileError: why a model file cannot be used, said in one line that names the file."""
from __future__ import annotations


class ModelFileError(Exception):
    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason
