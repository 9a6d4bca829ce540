"""`fanout promote`: a better draft is served, a worse one never, the flip is atomic.

    .venv/bin/pytest tests/test_promote.py -x -q

Two drafts of one tiny verifier, trained on its own greedy continuations of the held-out
prompts: one on the true next tokens (it accepts), one on shuffled targets (made worse
on purpose). Decisions are made by decoding both on the same prompts (EvalSession).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from fanout.bench.assets import generate_corpus, write_jsonl
from fanout.checkpoints.load import load_draft
from fanout.checkpoints.save import save_checkpoint
from fanout.decode.config import PromoteConfig
from fanout.decode.eval import EvalSession
from fanout.decode.promote import CURRENT, DECISIONS, Served, decide
from fanout.decode.spec_decode import Decoder
from fanout.errors import ConfigError
from fanout.families.dflash.model import DFlashDraft
from fanout.filesystem import FaultyFileSystem
from fanout.ops.adamw import make_optimizer
from forked_cli import ForkedPopen
from tiny_run import build_tiny_assets, one_thread  # noqa: F401 (one_thread: autouse)

LAYERS = [1, 2]
ENV = os.environ | {"OMP_NUM_THREADS": "1"}


def _train(session: EvalSession, shuffled: bool, save: Path, steps: int = 120) -> Path:
    """A block-4 DFlash draft trained on the verifier's greedy continuations of the
    session's prompts (`shuffled`: on a random permutation of its targets), saved."""
    torch.manual_seed(0)
    v = session.verifier
    draft = DFlashDraft.from_verifier(
        session.cfg.verifier_name_or_path, target_layer_ids=LAYERS, block_size=4, max_anchors=32
    )
    dec = Decoder(v, set())
    seqs = [p.ids + dec.greedy(p.ids, 40).tokens for p in session.prompts]
    t = max(len(s) for s in seqs)
    ids = torch.tensor([s + [0] * (t - len(s)) for s in seqs])  # [B, T]
    b = ids.shape[0]
    pos = torch.arange(t).expand(b, t)
    doc = torch.zeros(b, t, dtype=torch.long)
    cap = v.capture(ids, pos, doc)
    target = cap.target_ids.long()  # [B, T]
    if shuffled:
        gen = torch.Generator().manual_seed(1)
        target = target.flatten()[torch.randperm(target.numel(), generator=gen)].view(b, t)
    batch = {
        "hidden_states": cap.hidden_states.float(), "input_ids": ids, "target_ids": target,
        "loss_mask": torch.ones(b, t, dtype=torch.uint8), "document_ids": doc,
        "position_ids": pos,
    }  # fmt: skip
    opt, _ = make_optimizer(draft.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        out = draft.loss(batch, gen)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    return save_checkpoint(save, draft.eval(), opt, {"step": steps},
                           verifier_name_or_path=session.cfg.verifier_name_or_path)  # fmt: skip


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("promote")
    _, tok, ver = build_tiny_assets(root, generate_corpus(60, seed=3))
    held = write_jsonl(root / "held.jsonl", generate_corpus(8, seed=99))
    base = PromoteConfig(
        verifier_name_or_path=str(ver), tokenizer=str(tok), data=str(held), num_prompts=6,
        max_new_tokens=24, draft=[str(root / "drafts" / "good")], served=str(root / "served"),
    )  # fmt: skip
    session = EvalSession(base, LAYERS)
    good = _train(session, False, root / "drafts" / "good")
    bad = _train(session, True, root / "drafts" / "bad")
    return {"root": root, "base": base, "session": session, "good": good, "bad": bad,
            "tok": tok, "ver": ver, "held": held}  # fmt: skip


def _cfg(world: dict[str, Any], draft: Path, served: Path, **kw: Any) -> PromoteConfig:
    return world["base"].model_copy(update={"draft": [str(draft)], "served": str(served)} | kw)


def _promote(tmp_path: Path, *args: str) -> tuple[int, str]:
    """`fanout promote ARGS`, forked from the warm forkserver (forked_cli: a real process
    without its own interpreter start-up and imports); (exit code, stdout and stderr)."""
    log = tmp_path / "promote.log"
    return ForkedPopen(["promote", *args], log).wait(300), log.read_text()


def _decisions(served: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (served / DECISIONS).read_text().splitlines()]


def test_a_better_draft_is_promoted_a_worse_one_never(
    world: dict[str, Any], tmp_path: Path
) -> None:
    served, session = tmp_path / "served", world["session"]
    # the first candidate of an empty served dir is measured (alone), then promoted
    first = decide(_cfg(world, world["good"], tmp_path / "first"), session)
    assert first["promoted"] and first["why"] == "nothing served yet", first
    assert first["prompts"] == 6 and first["candidate_tau"] > 1.01 and not first["floor"]
    Served(served).promote(world["bad"], keep=3)  # the worse one served: v0001
    better = decide(_cfg(world, world["good"], served), session)
    assert better["promoted"], better
    assert better["candidate_tau"] > better["served_tau"]
    assert better["candidate_ci95"][0] > better["served_ci95"][1]  # intervals apart
    assert (served / CURRENT).resolve().name == "v0002"
    worse = decide(_cfg(world, world["bad"], served), session)
    assert not worse["promoted"], worse
    assert (served / CURRENT).resolve().name == "v0002"  # still the better one
    lines = _decisions(served)
    assert [d["promoted"] for d in lines] == [True, False]
    assert all(d["prompts"] == 6 for d in lines) and lines[0]["candidate_step"] == 120
    # what is served loads as a draft of the verifier, and is the good one's weights
    cur = load_draft(served / CURRENT, world["ver"])
    good = load_draft(world["good"], world["ver"])
    for (n, a), (_, b) in zip(cur.state_dict().items(), good.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
    assert not (served / "versions" / "v0002" / "resume.safetensors").exists()


def test_a_margin_decides_on_point_estimates(world: dict[str, Any], tmp_path: Path) -> None:
    served, session = tmp_path / "served", world["session"]
    Served(served).promote(world["bad"], keep=3)
    huge = decide(_cfg(world, world["good"], served, margin=100.0), session)
    assert not huge["promoted"] and "margin 100" in huge["why"]
    small = decide(_cfg(world, world["good"], served, margin=0.0), session)
    assert small["promoted"]


def test_a_flip_that_fails_leaves_the_served_version_whole(
    world: dict[str, Any], tmp_path: Path
) -> None:
    served = Served(tmp_path / "served")
    served.promote(world["bad"], keep=3)
    faulty = Served(tmp_path / "served", fs=FaultyFileSystem(fail_at=1, errno_=errno.EIO,
                                                             ops={"symlink"}))  # fmt: skip
    with pytest.raises(OSError):
        faulty.promote(world["good"], keep=3)
    assert (tmp_path / "served" / CURRENT).resolve().name == "v0001"
    load_draft(tmp_path / "served" / CURRENT, world["ver"])  # complete, loadable
    assert not [p for p in (tmp_path / "served").iterdir() if p.name.startswith(".current")]


def test_rollback_and_pruning_through_the_command(world: dict[str, Any], tmp_path: Path) -> None:
    served = Served(tmp_path / "served")
    for ckpt in (world["bad"], world["good"], world["bad"], world["good"]):
        served.promote(ckpt, keep=3)
    assert [v.name for v in served.versions()] == ["v0002", "v0003", "v0004"]
    code, out = _promote(tmp_path, "--served", str(tmp_path / "served"), "--rollback")
    assert code == 0, out
    assert "v0004 -> v0003" in out
    assert (tmp_path / "served" / CURRENT).resolve().name == "v0003"
    assert _decisions(tmp_path / "served")[-1] == {**_decisions(tmp_path / "served")[-1],
                                                   "rollback": True, "to": "v0003"}  # fmt: skip


def test_served_that_is_not_ours_is_refused_in_one_line(
    world: dict[str, Any], tmp_path: Path
) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "weights.bin").write_bytes(b"x")
    with pytest.raises(ConfigError, match="holds something other than promoted checkpoints"):
        Served(other)
    code, out = _promote(
        tmp_path, "--served", str(other), "--once", "--draft", str(world["good"]),
        "--verifier-name-or-path", str(world["ver"]), "--tokenizer", str(world["tok"]),
        "--data", str(world["held"]),
    )  # fmt: skip
    assert code == 1
    assert out.strip().count("\n") == 0 and "--served" in out, out  # stdout empty too
    assert (other / "weights.bin").read_bytes() == b"x"  # nothing touched


def test_drift_is_recorded_and_flagged_below_the_promoted_interval(
    world: dict[str, Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """--run-dir of a live run: each look decodes the served draft on the newest held-out
    conversations and records τ with its interval. A version flipped in without a
    measured decision has its first record as its baseline; a version promoted with
    an interval is held to that one, and a look whose interval lies wholly below it is
    flagged (here: a version whose recorded win is out of the tiny draft's reach)."""
    from fanout.decode.config import HELDOUT
    from fanout.decode.promote import DRIFT, drift

    run, served = tmp_path / "run", tmp_path / "served"
    (run / "follow").mkdir(parents=True)
    heldout = run / "follow" / HELDOUT
    heldout.write_text(world["held"].read_text())
    cfg = _cfg(world, world["good"], served).model_copy(
        update={"run_dir": str(run), "data": str(heldout)}
    )
    Served(served).promote(world["good"], keep=3)  # flipped in: no decision measured it
    first = drift(cfg)
    assert first is not None and first["baseline_ci95"] is None and first["below"] is False
    more = "".join(json.dumps(c) + "\n" for c in generate_corpus(8, seed=4242))
    heldout.write_text(heldout.read_text() + more)  # the traffic grew: a newer slice
    again = drift(cfg)
    assert again is not None and again["heldout_seen"] == 16
    assert again["baseline_ci95"] == first["ci95"] and again["prompts"] == 6
    assert again["below"] == (again["ci95"][1] < first["ci95"][0])
    # a version that won its promotion with a higher interval than it now shows
    with open(served / "promotions.jsonl", "a") as f:
        f.write(json.dumps({"promoted": True, "version": "v0001",
                            "candidate_ci95": [again["ci95"][1] + 0.5, 9.0]}) + "\n")  # fmt: skip
    low = drift(cfg)
    assert low is not None and low["below"] is True
    assert low["baseline_ci95"] == [again["ci95"][1] + 0.5, 9.0]
    lines = [json.loads(x) for x in (run / "follow" / DRIFT).read_text().splitlines()]
    assert [d["below"] for d in lines] == [False, again["below"], True]
    assert "drift: the served draft v0001" in caplog.text


def test_a_candidate_pruned_while_it_is_copied_is_never_served(
    world: dict[str, Any], tmp_path: Path
) -> None:
    """Its trainer keeps only its last few checkpoints: one pruned between its evaluation
    and its copy has lost files. No version is made of what is left, `current` stays."""
    served = Served(tmp_path / "served")
    served.promote(world["bad"], keep=3)
    pruned = tmp_path / "checkpoint-00000120"
    pruned.mkdir()
    (pruned / "config.json").write_bytes((world["good"] / "config.json").read_bytes())
    with pytest.raises(ConfigError, match=r"model\.safetensors went away"):
        served.promote(pruned, keep=3)
    assert [v.name for v in served.versions()] == ["v0001"]
    assert (tmp_path / "served" / CURRENT).resolve().name == "v0001"
    assert sorted(p.name for p in (tmp_path / "served" / "versions").iterdir()) == ["v0001"]


def test_a_rollback_sticks_until_a_later_step_exists(world: dict[str, Any], tmp_path: Path) -> None:
    """#52: the next look after `--rollback` re-promoted the rolled-back checkpoint as a
    new version. Now it is barred (one decision line saying why) until a checkpoint of a
    later step of the same save path exists."""
    served, session = tmp_path / "served", world["session"]
    Served(served).promote(world["bad"], keep=3)  # v0001
    assert decide(_cfg(world, world["good"], served), session)["promoted"]  # v0002
    code, out = _promote(tmp_path, "--served", str(served), "--rollback")
    assert code == 0, out
    rolled = _decisions(served)[-1]
    assert rolled["from_candidate"] == str(world["good"].resolve())
    assert rolled["from_step"] == 120
    again = decide(_cfg(world, world["good"], served), session)
    assert not again["promoted"] and "rolled back" in again["why"], again
    assert (served / CURRENT).resolve().name == "v0001"
    # a later step of the same save path is a candidate again
    later = world["good"].with_name(world["good"].name + "-later")
    shutil.copytree(world["good"], later)
    state = json.loads((later / "training_state.json").read_text())
    (later / "training_state.json").write_text(json.dumps(state | {"step": 121}))
    assert decide(_cfg(world, later, served), session)["promoted"]
    assert (served / CURRENT).resolve().name == "v0003"


def test_a_rollback_before_the_promoters_decision_line_still_bars_its_checkpoint(
    world: dict[str, Any], tmp_path: Path
) -> None:
    """#52's half-hour soak: a rollback ran after a promoter flipped `current` to a new
    version and before it appended that decision's line; the rollback found no line
    naming the version's checkpoint, recorded `from_candidate: null`, and so barred
    nothing (the checkpoint could be promoted again). Each version now records where it
    came from, and the rollback reads it there."""
    served = Served(tmp_path / "served")
    served.promote(world["good"], keep=10)  # v0001
    served.promote(world["bad"], keep=10)  # v0002 live; its decision line not written yet
    rolled = served.rollback_record(*served.rollback())
    served.record(rolled)
    step = json.loads((world["bad"] / "training_state.json").read_text())["step"]
    assert (rolled["from"], rolled["to"]) == ("v0002", "v0001")
    assert (rolled["from_candidate"], rolled["from_step"]) == (str(world["bad"].resolve()), step)
    assert served.barred(world["bad"], step) is not None


def test_a_second_rollback_never_re_serves_the_first_ones_version(
    world: dict[str, Any], tmp_path: Path
) -> None:
    """#52: `--rollback` went to the version just below `current`, even one an earlier
    rollback took off serving: v0003 rolled back, v0004 promoted, a rollback of v0004
    served v0003 again (the soak of the live loop found it). It goes to v0002."""
    served = Served(tmp_path / "served")
    for ckpt in (world["bad"], world["good"], world["bad"]):
        served.promote(ckpt, keep=10)  # v0001-v0003
    served.record(served.rollback_record(*served.rollback()))  # v0003 -> v0002
    served.promote(world["good"], keep=10)  # v0004
    was, now = served.rollback()
    assert (was.name, now.name) == ("v0004", "v0002")
    served.record(served.rollback_record(was, now))
    served.record(served.rollback_record(*served.rollback()))  # v0002 -> v0001
    with pytest.raises(ConfigError, match="no earlier version to roll back to"):
        served.rollback()  # v0001 is the oldest


def test_run_dir_gives_the_verifier_and_tokenizer_the_run_recorded(tmp_path: Path) -> None:
    """#52: `promote --run-dir` demanded --verifier-name-or-path and --tokenizer that the
    run already knows. The producer records both in stream.json; promote takes them from
    there (flags given win), asks for them in one line when an older run lacks them, and
    its --help says they are not required with --run-dir."""
    import argparse

    from pydantic import ValidationError

    from fanout.decode.config import HELDOUT
    from fanout.decode.promote import add_arguments
    from fanout.store.rundir import RunDir
    from fanout.store.streaminfo import StreamInfo

    run, ver, tok, other = (tmp_path / n for n in ("run", "ver", "tok", "other"))
    for d in (run / "follow", ver, tok, other):
        d.mkdir(parents=True)
    (run / "follow" / HELDOUT).write_text("{}\n")
    kw = {"run_dir": str(run), "draft": [str(tmp_path / "d")], "served": str(tmp_path / "s")}
    StreamInfo.of("s1", None, 2, 1).write(RunDir(run))  # an older producer: neither
    with pytest.raises(ValidationError, match=r"records no verifier.*--verifier-name-or-path"):
        PromoteConfig(**kw)
    StreamInfo.of("s1", None, 2, 1, verifier=str(ver), tokenizer=str(tok)).write(RunDir(run))
    cfg = PromoteConfig(**kw)
    assert (cfg.verifier_name_or_path, cfg.tokenizer) == (str(ver), str(tok))
    assert cfg.data == str(run / "follow" / HELDOUT)
    given = PromoteConfig(**kw, verifier_name_or_path=str(other), tokenizer=str(other))
    assert (given.verifier_name_or_path, given.tokenizer) == (str(other), str(other))
    p = argparse.ArgumentParser()
    add_arguments(p)
    text = " ".join(p.format_help().split())
    for flag in ("--verifier-name-or-path", "--tokenizer", "--data"):
        meta = flag[2:].upper().replace("-", "_")
        said = text.split(f"{flag} {meta} ", 1)[1]  # its help, not the usage line
        nxt = re.search(r" --[a-z-]+ [A-Z_]+ ", said)  # where the next option's help starts
        said = said[: nxt.start() if nxt else None]
        assert said.endswith("(required unless --run-dir)"), (flag, said)


def test_a_draft_at_the_acceptance_floor_is_never_served_and_says_so(
    world: dict[str, Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """#52: a draft never trained (acceptance pinned at 0) was served as the first
    version, silently. Now the first candidate is measured too, and one at the floor
    (τ <= 1 + --floor-epsilon) is refused: an error line, `floor` in its decision and,
    with --run-dir, in `fanout status` (a FLOOR line, /metrics fanout_promote_floor 1);
    `--once` exits 3. The command takes the verifier and tokenizer from the run."""
    from fanout.decode.config import HELDOUT, PROMOTE
    from fanout.status.serve import metrics_text
    from fanout.status.snapshot import build, snapshot
    from fanout.status.table import format_table
    from fanout.store.rundir import RunDir
    from fanout.store.streaminfo import StreamInfo
    from test_coordinator import new_run

    draft = DFlashDraft.from_verifier(
        str(world["ver"]), target_layer_ids=LAYERS, block_size=4, max_anchors=32
    )
    with torch.no_grad():
        for p in draft.parameters():
            p.zero_()  # its every guess is token 0: never the verifier's
    opt, _ = make_optimizer(draft.parameters(), lr=1e-3)
    dead = save_checkpoint(tmp_path / "drafts" / "dead", draft.eval(), opt, {"step": 50},
                           verifier_name_or_path=str(world["ver"]))  # fmt: skip
    co, _, _ = new_run(tmp_path)  # a live run: tmp_path/run
    run, served = tmp_path / "run", tmp_path / "served"
    (run / "follow").mkdir(parents=True, exist_ok=True)
    (run / "follow" / HELDOUT).write_text(world["held"].read_text())
    got = decide(_cfg(world, dead, served, run_dir=str(run)), world["session"])
    assert not got["promoted"] and got["floor"] is True, got
    assert got["candidate_tau"] <= 1.01 and "at the floor" in got["why"]
    assert not (served / CURRENT).exists()  # nothing served
    assert _decisions(served)[-1]["floor"] is True
    assert "at the acceptance floor" in caplog.text
    said = json.loads((run / "follow" / PROMOTE).read_text())
    assert said["floor"] is True and said["candidate"] == str(dead.resolve())
    s = snapshot(co)
    assert s["promote"]["floor"] is True and s["promote"]["promoted"] is False
    assert "FLOOR: its drafts are (next to) never accepted" in format_table(s)
    assert "fanout_promote_floor 1" in metrics_text(build(co))
    co.close()
    # the command, from cron: no --verifier-name-or-path, --tokenizer or --data (the run's)
    StreamInfo.of("s", None, 2, 1, verifier=str(world["ver"]), tokenizer=str(world["tok"])
                  ).write(RunDir(run))  # fmt: skip
    r = subprocess.run(
        [sys.executable, "-m", "fanout.cli", "promote", "--run-dir", str(run), "--once",
         "--draft", str(dead), "--served", str(served), "--num-prompts", "6",
         "--max-new-tokens", "24"],
        capture_output=True, text=True, env=ENV, timeout=600,
    )  # fmt: skip
    assert r.returncode == 3, r.stderr[-2000:]
    assert "is at the acceptance floor" in r.stderr.splitlines()[-1], r.stderr[-2000:]
    assert not (served / CURRENT).exists()


def test_a_changing_verifier_is_the_one_measured_and_each_record_names_it(
    world: dict[str, Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """#52: with --verifier-name-or-path a policy in training (versions/vNNNN, current,
    COMMITTED), decisions and drift looks evaluate against its live version and say
    which; the first drift look after the policy moved re-measures the served draft and
    names both versions. v0002 here is a copy whose layers are noised: measured against it,
    the draft's τ must differ from v0001's (so the live version is what was loaded)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from fanout.checkpoints.layout import MARKER
    from fanout.decode.config import HELDOUT
    from fanout.decode.promote import DRIFT, drift

    policy = tmp_path / "policy"
    for n in (1, 2):
        v = policy / "versions" / f"v{n:04d}"
        shutil.copytree(world["ver"], v)
        if n == 2:
            for f in v.glob("*.safetensors"):
                t = load_file(f)
                g = torch.Generator().manual_seed(0)
                noisy = {k: (x + torch.randn(x.shape, generator=g).to(x.dtype) if ".layers." in k
                             else x) for k, x in t.items()}  # fmt: skip
                save_file(noisy, f)
        (v / MARKER).write_text("")
    (policy / "current").symlink_to("versions/v0001")
    run, served = tmp_path / "run", tmp_path / "served"
    (run / "follow").mkdir(parents=True)
    heldout = run / "follow" / HELDOUT
    heldout.write_text(world["held"].read_text())
    cfg = _cfg(world, world["good"], served).model_copy(
        update={"run_dir": str(run), "data": str(heldout), "verifier_name_or_path": str(policy),
                "floor_epsilon": -1.0}
    )  # fmt: skip
    first = decide(cfg)
    assert first["verifier_version"] == "v0001" and first["promoted"]
    one = drift(cfg)
    assert one is not None and (one["verifier_version"], one["verifier_was"]) == ("v0001", None)
    (policy / "current").unlink()
    (policy / "current").symlink_to("versions/v0002")
    caplog.set_level("INFO", logger="fanout")
    two = drift(cfg)
    assert two is not None and (two["verifier_version"], two["verifier_was"]) == ("v0002", "v0001")
    assert two["tau"] != one["tau"]  # measured against v0002's weights, not v0001's
    assert "the verifier changed v0001 -> v0002" in caplog.text
    lines = [json.loads(x) for x in (run / "follow" / DRIFT).read_text().splitlines()]
    assert [d["verifier_version"] for d in lines] == ["v0001", "v0002"]
    plain = decide(_cfg(world, world["good"], tmp_path / "plain"), world["session"])
    assert plain["verifier_version"] is None  # a plain model directory names no version
