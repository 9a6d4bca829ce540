"""Adding a family is one new folder and one registry line, counted: the test copies the
package, adds a family the way docs/training.md ("Adding a family") says — a folder with
its Family and its model (config, flag, loss, export, proposer from the shared parts) and
its name in `FAMILY_FOLDERS` — counts what changed against the original, and then runs
the real commands on the copy: `fanout produce --capture-for` it, `fanout train
--draft-family` it with its own flag, the checkpoint reads back as its family, and
`fanout eval` decodes it losslessly.

    pytest tests/test_family_newcomer.py -q      # prints the newcomer count
"""

from __future__ import annotations

import difflib
import json
import shutil
import subprocess
import sys
from pathlib import Path

from fanout.bench.assets import generate_corpus, write_jsonl
from fanout.checkpoints.layout import latest_checkpoint
from test_roles import ENV
from tiny_run import build_tiny_assets, one_thread  # noqa: F401 (autouse)

SRC = Path(__file__).resolve().parents[1] / "src"

# The newcomer: DFlash's block drafter with a flag of its own that switches the slot
# decay off (every drafted slot weighs 1). Its whole code, as a user would write it.
INIT = '''"""ToyFlash: DFlash's drafter trained with every drafted slot weighted alike."""

from typing import Any, ClassVar

from pydantic import BaseModel, Field

from fanout.families.base import Family
from fanout.model.draft_config import DraftConfig


class ToyFlashRecipe(BaseModel):
    toyflash_flat_weights: bool = Field(False, description="weigh every drafted slot alike")


class ToyFlashConfig(ToyFlashRecipe, DraftConfig):
    """The draft's config: the shared fields plus its own."""


class ToyFlash(Family):
    name = "toyflash"
    model_ref = "fanout.families.toyflash.model:ToyFlashDraft"
    config_class = ToyFlashConfig
    recipe = ToyFlashRecipe
    recipe_defaults: ClassVar[dict[str, Any]] = {"block_size": 4}
    speculators_model_type = "toyflash"
    architectures = ("ToyFlashDraftModel",)
    serving_method = "dflash"

    def serving_fields(self) -> list[str]:
        return ["toyflash_flat_weights"]


FAMILY = ToyFlash()
'''

MODEL = '''"""ToyFlash's model: the shared block drafter, its own slot weights."""

import torch

from fanout.model.block_draft import BlockDraft
from fanout.model.draft import LossOutput
from fanout.families.toyflash import ToyFlashConfig


class ToyFlashDraft(BlockDraft):
    config_class = ToyFlashConfig

    def slot_weights(self, ce, sup, slot):
        if self.cfg.toyflash_flat_weights:
            return torch.ones_like(ce)
        return super().slot_weights(ce, sup, slot)

    def loss(self, batch, generator) -> LossOutput:
        return self.block_loss(batch, self.blocks(batch, generator))
'''


def _tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): p.read_text()
        for p in sorted(root.rglob("*.py"))
        if "__pycache__" not in p.parts
    }


def _add_the_family(pkg: Path) -> None:
    """What docs/training.md tells a newcomer to do."""
    folder = pkg / "fanout" / "families" / "toyflash"
    folder.mkdir()
    (folder / "__init__.py").write_text(INIT)
    (folder / "model.py").write_text(MODEL)
    registry = pkg / "fanout" / "families" / "registry.py"
    text = registry.read_text()
    old = 'FAMILY_FOLDERS = ("dflash", '
    assert text.count(old) == 1, "FAMILY_FOLDERS is no longer one line"
    registry.write_text(text.replace(old, 'FAMILY_FOLDERS = ("toyflash", "dflash", '))


def newcomer_count(before: dict[str, str], after: dict[str, str]) -> dict[str, object]:
    """Files created and changed, and the changed lines of each changed file."""
    created = sorted(set(after) - set(before))
    changed = {
        name: sum(
            1
            for line in difflib.unified_diff(before[name].splitlines(), after[name].splitlines())
            if line.startswith("+") and not line.startswith("+++")
        )
        for name in sorted(set(before) & set(after))
        if before[name] != after[name]
    }
    return {
        "folders": sorted({str(Path(c).parent) for c in created}),
        "created": created,
        "changed": changed,
    }


def test_a_new_family_is_one_folder_and_one_registry_line(tmp_path: Path) -> None:
    pkg = tmp_path / "src"
    shutil.copytree(SRC / "fanout", pkg / "fanout", ignore=shutil.ignore_patterns("__pycache__"))
    before = _tree(pkg)
    _add_the_family(pkg)
    count = newcomer_count(before, _tree(pkg))
    print("newcomer count:", json.dumps(count))
    assert count["folders"] == ["fanout/families/toyflash"]
    assert count["changed"] == {"fanout/families/registry.py": 1}

    # the copy with the newcomer, run the way users run it
    env = {**ENV, "PYTHONPATH": str(pkg)}

    def fanout(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "fanout.cli", *args]
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)

    where = subprocess.run(
        [sys.executable, "-c", "import fanout; print(fanout.__file__)"],
        capture_output=True, text=True, env=env, check=True,
    ).stdout.strip()  # fmt: skip
    assert where.startswith(str(pkg)), where

    assets = tmp_path / "assets"
    _, tok, verifier = build_tiny_assets(assets, generate_corpus(12, seed=0))
    run, save = tmp_path / "run", tmp_path / "draft"
    r = fanout(
        "produce", "--run-dir", str(run), "--verifier-name-or-path", str(verifier),
        "--tokenizer", str(tok), "--data", str(assets / "chat.jsonl"), "--seq-len", "64",
        "--window-rows", "4", "--max-live-windows", "64", "--capture-for", "toyflash",
        "--expected-consumers", "1", "--workers", "1", "--exit-when-idle-s", "0",
        "--cache-dir", str(tmp_path / "cache"),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    r = fanout(
        "train", "--run-dir", str(run), "--consumer-id", "toy", "--draft-family", "toyflash",
        "--toyflash-flat-weights", "--verifier-name-or-path", str(verifier),
        "--num-layers", "1", "--max-anchors", "8", "--rows-per-step", "1",
        "--max-steps", "3", "--save-path", str(save),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    ckpt = latest_checkpoint(save)
    assert ckpt is not None
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["speculators_model_type"] == "toyflash" and cfg["fanout"]["family"] == "toyflash"
    assert cfg["toyflash_flat_weights"] is True and cfg["block_size"] == 4

    held = write_jsonl(tmp_path / "held.jsonl", generate_corpus(2, seed=9))
    r = fanout(
        "eval", "--verifier-name-or-path", str(verifier), "--tokenizer", str(tok),
        "--data", str(held), "--num-prompts", "2", "--max-new-tokens", "12",
        "--draft", str(save), "--json", str(tmp_path / "eval.json"),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads((tmp_path / "eval.json").read_text())
    assert rep["lossless"], rep["mismatches"]
    assert [d["family"] for d in rep["drafts"].values()] == ["toyflash"]
    # its flag is its own: given to another family, one line and exit 1
    r = fanout(
        "train", "--run-dir", str(run), "--consumer-id", "other", "--draft-family", "dflash",
        "--toyflash-flat-weights", "--verifier-name-or-path", str(verifier),
        "--save-path", str(tmp_path / "other"),
    )  # fmt: skip
    assert r.returncode == 1
    assert "toyflash option(s), but --draft-family is dflash" in r.stderr.strip().splitlines()[-1]
