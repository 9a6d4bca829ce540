"""Shared fixtures. Test data comes from ../shared/data (never copied here)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("FANOUT_SHARED_DATA", REPO.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """../shared/data: real chat datasets and the Qwen3 tokenizer (see its README)."""
    if not (SHARED_DATA / "chat").is_dir():
        pytest.skip(f"shared test data not found at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir(shared_data: Path) -> Path:
    return shared_data / "tokenizers" / "qwen3"
