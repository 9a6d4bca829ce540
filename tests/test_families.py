"""The draft-family seam: one capture, drafts of every family from it.

- `--draft-family` options: a family's own flags are refused for another family, its
  reference values apply where the shared flags are not given;
- `fanout produce --capture-for`: the union of the families' layers (capped on a
  shallow verifier) and the tensors they need;
- a family that needs a tensor the run lacks is refused at start, naming the flag;
- a checkpoint of one family is refused where another is expected (resume);
- one run, three trainers of three families (as real processes): different lengths,
  one stopped and resumed, each ends on its own terms; `fanout eval` then decodes the
  three in one run, lossless, each as its own family.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file

from fanout.bench.assets import generate_corpus, tiny_qwen3_verifier, write_jsonl
from fanout.checkpoints.format import read_config
from fanout.checkpoints.layout import latest_checkpoint
from fanout.checkpoints.load import load_draft
from fanout.checkpoints.resume import load_checkpoint
from fanout.checkpoints.save import save_checkpoint
from fanout.cli import build_parser
from fanout.errors import CheckpointError, ConfigError
from fanout.families.chain import ChainFamily
from fanout.families.registry import FAMILIES, family, family_of_draft
from fanout.model.draft_config import ChainConfig
from fanout.produce.capture_for import capture_fields
from fanout.produce.config import ProducerConfig
from fanout.train.config import TrainConfig
from fanout.train.trainer import config_from_args
from fanout.train.trainlog import read_train_log
from test_endings import Procs, _alive, _summary
from test_roles import ENV, _status, wait_for
from tiny_run import build_tiny_assets, one_thread  # noqa: F401 (autouse)

BASE = [
    "--run-dir", "r", "--consumer-id", "c", "--verifier-name-or-path", "v", "--save-path", "s",
]  # fmt: skip


def _train_cfg(*flags: str) -> TrainConfig:
    args = build_parser(["train"]).parse_args(["train", *BASE, *flags])
    return config_from_args(args)


def test_an_option_of_another_family_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError) as e:
        _train_cfg("--draft-family", "dspark", "--selector-rank", "8")
    msg = str(e.value)
    assert "--selector-rank" in msg and "dflash2" in msg and "--draft-family is dspark" in msg
    assert "--markov-rank" in msg  # the chosen family's own options are named
    with pytest.raises(ConfigError, match=r"--markov-rank: dspark option.*its options: none"):
        _train_cfg("--markov-rank", "8")  # dflash, the default family, has none
    assert _train_cfg("--draft-family", "dflash2", "--selector-rank", "8").selector_rank == 8


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (("--block-size", "8"), "--block-size 8: EAGLE-3 drafts a chain"),
        (("--ttt-steps", "4", "--block-size", "4"), "--ttt-steps + 1 = 5"),
        (("--gamma", "4"), "--gamma 4.0: EAGLE-3 weighs"),
        (("--per-position-loss-weight", "dpace"), "--per-position-loss-weight dpace"),
        (("--label-source", "input_ids"), "--label-source input_ids"),
    ],
)
def test_a_shared_flag_eagle3_cannot_use_is_refused_when_parsed(
    flags: tuple[str, ...], named: str
) -> None:
    """Block-family flags mean nothing to a chain draft: refused at parse time (before
    the trainer waits for a run), in one line naming the flag; a block size equal to
    --ttt-steps + 1 (or the shared default, as a whole config written back carries it)
    is accepted."""
    with pytest.raises(ConfigError, match=named.replace("+", r"\+")):
        _train_cfg("--draft-family", "eagle3", *flags)
    assert _train_cfg("--draft-family", "eagle3", "--ttt-steps", "4", "--block-size", "5")
    assert _train_cfg("--draft-family", "eagle3", "--block-size", "16")
    assert _train_cfg("--draft-family", "dspark", "--gamma", "4").gamma == 4  # a block family


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_family_declares_its_config_and_model_once(name: str) -> None:
    """The registry names each family's model by reference (imported with torch on first
    use) and its config class directly: the two must agree, the model's module is the
    family's own folder, and the model is a `Draft`."""
    from fanout.model.draft import Draft

    fam = FAMILIES[name]
    assert fam.draft_class.config_class is fam.config_class
    assert fam.model_ref.split(":")[0] == f"fanout.families.{name}.model"
    assert issubclass(fam.draft_class, Draft)


# a tiny draft's shapes, what every family's config takes beside its recipe
SHAPES: dict[str, Any] = {
    "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 256, "mask_token_id": 255,
    "target_layer_ids": [1],
}  # fmt: skip


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_family_config_is_frozen_and_refuses_unknown_fields(name: str) -> None:
    """DraftConfig declares frozen / extra="forbid" once; every family's config (its
    recipe mixin first among its bases) inherits both."""
    fam = FAMILIES[name]
    cfg = fam.config_class(**SHAPES, block_size=fam.block_size_for(4))
    with pytest.raises(ValidationError, match="frozen"):
        cfg.hidden_size = 64  # type: ignore[misc]
    with pytest.raises(ValidationError, match="Extra inputs"):
        fam.config_class(**SHAPES, block_size=fam.block_size_for(4), not_a_field=1)


@pytest.mark.parametrize(
    ("name", "fc_norm", "on"),
    [("eagle3", False, True), ("eagle3", True, False), ("peagle", False, False),
     ("peagle", True, False)],
)  # fmt: skip
def test_an_unset_norm_before_fc_is_what_the_familys_trainer_resolves(
    name: str, fc_norm: bool, on: bool
) -> None:
    """`--norm-before-fc` unset (None, EAGLE-3's flag): on unless --fc-norm for EAGLE-3,
    off for P-EAGLE (speculators' trainers), resolved by their shared ChainConfig."""
    fam = FAMILIES[name]
    width = fam.block_size_for(4)
    cfg = fam.config_class(**SHAPES, block_size=width, fc_norm=fc_norm, norm_before_fc=None)
    assert isinstance(cfg, ChainConfig) and cfg.norm_before_fc is on


@pytest.mark.parametrize("name", [n for n, f in FAMILIES.items() if isinstance(f, ChainFamily)])
def test_every_chain_familys_steps_flag_says_what_it_means(name: str) -> None:
    """A chain family's steps flag (`SharedRule.steps_field`) is `steps_flag`'s: at least
    one step, its help saying what it means to eval and the verify width."""
    fam = FAMILIES[name]
    assert isinstance(fam, ChainFamily)
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        fam.recipe(**{fam.steps_field: 0})
    help_ = fam.recipe.model_fields[fam.steps_field].description or ""
    assert "--num-speculative-tokens" in help_ and help_.endswith("verify width = this + 1")


def test_unknown_family_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"'eagle9'.*known: dflash, dflash2, dspark"):
        family("eagle9")
    r = subprocess.run(
        [sys.executable, "-m", "fanout.cli", "train", *BASE, "--draft-family", "eagle9"],
        capture_output=True, text=True, env=ENV, timeout=120,
    )  # fmt: skip
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr  # one line, exit 1
    assert "--draft-family" in r.stderr and "'dflash2'" in r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "fanout.cli", "train", *BASE, "--draft-family", "eagle3",
         "--gamma", "4"],
        capture_output=True, text=True, env=ENV, timeout=120,
    )  # fmt: skip
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert "--gamma" in r.stderr


def test_reference_values_apply_where_not_given() -> None:
    """DFlash2 and DSpark train block 8 unless told (512 anchors, as DFlash)."""
    assert _train_cfg().draft_recipe()["block_size"] == 16
    r2 = _train_cfg("--draft-family", "dflash2").draft_recipe()
    assert r2["block_size"] == 8 and r2["selector_top_k"] == 16
    rs = _train_cfg("--draft-family", "dspark").draft_recipe()
    assert (rs["block_size"], rs["max_anchors"]) == (8, 512)
    assert (
        _train_cfg("--draft-family", "dspark", "--block-size", "4").draft_recipe()["block_size"]
        == 4
    )
    # every family's options reach its draft config (no other family's)
    assert "markov_rank" in rs and "selector_rank" not in rs


def test_capture_for_takes_the_union_and_the_tensors(tmp_path: Path) -> None:
    dflash = family("dflash")
    assert dflash.default_layers(36) == [1, 9, 17, 25, 33]  # DFlash's rule at full depth
    assert dflash.default_layers(6) == [1, 2, 3]  # the demo's 6 layers: what fits in [1, L-3]
    ver = tiny_qwen3_verifier(tmp_path / "v", 64, hidden_size=32, num_layers=6)
    base: dict[str, Any] = {
        "run_dir": str(tmp_path / "r"), "verifier_name_or_path": str(ver), "data": ["d.jsonl"],
    }  # fmt: skip
    got = capture_fields(ProducerConfig(**base, capture_for=["dflash", "dspark"]))
    assert got == {"capture_layer_ids": [1, 2, 3], "store_last_hidden_states": True}
    got = capture_fields(ProducerConfig(**base, capture_for=["dflash2"]))
    assert got == {"capture_layer_ids": [1, 2, 3], "store_last_hidden_states": False}
    got = capture_fields(
        ProducerConfig(**base, capture_for="dflash,dflash2", capture_layer_ids=[0, 5])
    )
    assert got["capture_layer_ids"] == [0, 1, 2, 3, 5]
    assert capture_fields(ProducerConfig(**base)) == {}
    # EAGLE-3: vLLM's (2, n//2, n-3) in HF numbering = fanout 1, 2 on 6 layers, with the
    # last hidden states (its targets); with DFlash's, the union
    got = capture_fields(ProducerConfig(**base, capture_for=["eagle3"]))
    assert got == {"capture_layer_ids": [1, 2], "store_last_hidden_states": True}
    assert family("eagle3").default_layers(36) == [1, 17, 32]  # Qwen3-8B: HF 2, 18, 33
    got = capture_fields(ProducerConfig(**base, capture_for="eagle3,dflash2"))
    assert got == {"capture_layer_ids": [1, 2, 3], "store_last_hidden_states": True}
    with pytest.raises(ValueError, match="capture_for"):
        ProducerConfig(**base, capture_for=["dflash", "medusa"])


def test_one_declaration_of_the_last_states_decides_capture_and_trainer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A family that declares it trains on the verifier's final hidden states (only
    `needs_last_hidden_states`, nothing else) gets them captured by `--capture-for` and is
    accepted by the trainer on that capture; a capture without them is refused with
    advice that fixes it."""
    from fanout.contract import CaptureContract
    from fanout.families.dflash import DFlash
    from fanout.train.setup import check_run

    class Needy(DFlash):
        def needs_last_hidden_states(self, recipe: Any) -> bool:
            return True

    monkeypatch.setitem(FAMILIES, "dflash", Needy())
    ver = tiny_qwen3_verifier(tmp_path / "v", 64, hidden_size=32, num_layers=6)
    base: dict[str, Any] = {
        "run_dir": str(tmp_path / "r"), "verifier_name_or_path": str(ver), "data": ["d.jsonl"],
    }  # fmt: skip
    got = capture_fields(ProducerConfig(**base, capture_for=["dflash"]))
    assert got == {"capture_layer_ids": [1, 2, 3], "store_last_hidden_states": True}

    def contract(last: bool) -> CaptureContract:
        return CaptureContract(
            verifier_config_hash="c", verifier_weights_fingerprint="w", verifier_num_layers=6,
            hidden_size=32, vocab_size=64, target_layer_ids=tuple(got["capture_layer_ids"]),
            store_last_hidden_states=last, dataset_fingerprint="d", tokenizer_fingerprint="t",
            seq_len=64, window_rows=4, shuffle_seed=0,
        )  # fmt: skip

    cfg = _train_cfg("--verifier-name-or-path", str(ver), "--run-dir", str(tmp_path / "r"))
    assert check_run(cfg, contract(got["store_last_hidden_states"]), world=1) == [1, 2, 3]
    with pytest.raises(ConfigError, match="--capture-for dflash"):
        check_run(cfg, contract(False), world=1)
    # a recipe that needs them where the family's reference does not (--loss-type kl):
    # --capture-for would not capture them, so the advice is the flag that does
    monkeypatch.setitem(FAMILIES, "dflash", DFlash())
    kl = _train_cfg(
        "--verifier-name-or-path", str(ver), "--run-dir", str(tmp_path / "r"), "--loss-type", "kl"
    )
    with pytest.raises(ConfigError) as e:
        check_run(kl, contract(False), world=1)
    assert "--store-last-hidden-states" in str(e.value)
    assert "--capture-for" not in str(e.value)


@pytest.fixture(scope="module")
def ver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_qwen3_verifier(
        tmp_path_factory.mktemp("fam") / "v", 128, hidden_size=32, num_layers=4
    )


def _draft(name: str, ver: Path) -> Any:
    torch.manual_seed(0)
    bs = family(name).block_size_for(4)  # a chain family's own verify width
    # MTP reads the verifier's last layer only (the layers its trainer picks)
    layers = family(name).draft_layers([1, 2], ver) if name == "mtp" else [1, 2]
    return family(name).build(
        ver, target_layer_ids=layers, block_size=bs, max_anchors=8, num_layers=1
    )


def test_every_family_decodes_what_hf_generate_decodes(ver: Path) -> None:
    """T = 0 is lossless against the peer's own greedy loop: HF `generate` (do_sample
    False, no stop token) gives the tokens `Decoder.greedy` gives, and each family's
    speculative decoding gives them too (the per-family tests compare trained drafts
    with `Decoder.greedy`; this ties both to transformers)."""
    from fanout.decode.spec_decode import Decoder
    from fanout.model.verifier import load_verifier

    v = load_verifier(ver, device="cpu", capture_layer_ids=[1, 2], num_draft_layers=None)
    v.model.generation_config.eos_token_id = None  # decode the full length
    dec = Decoder(v, set())
    drafts = {n: _draft(n, ver) for n in sorted(FAMILIES)}
    g = torch.Generator().manual_seed(7)
    for n in (3, 17, 40):
        prompt = torch.randint(0, 120, (n,), generator=g).tolist()
        ids = torch.tensor([prompt])  # [1, n]; the mask given: token 0 is no padding here
        hf = v.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, do_sample=False,
            pad_token_id=0,
        )[0, n:].tolist()  # fmt: skip
        assert dec.greedy(prompt, 30).tokens == hf
        for name, d in drafts.items():
            assert dec.speculative(prompt, d, 30).tokens == hf, (name, n)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_family_round_trips_its_checkpoint(name: str, ver: Path, tmp_path: Path) -> None:
    d = _draft(name, ver)
    assert family_of_draft(d) is FAMILIES[name]
    opt = torch.optim.SGD(d.parameters(), lr=0.1)
    path = save_checkpoint(tmp_path, d, opt, {"step": 0}, verifier_name_or_path=str(ver))
    cfg = read_config(path)
    fam = FAMILIES[name]
    assert cfg["speculators_model_type"] == fam.speculators_model_type
    assert cfg["fanout"]["family"] == name
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == (
        fam.speculative_tokens(d.cfg)
    )
    back = load_draft(path, ver)
    assert type(back) is type(d) and back.cfg.model_dump() == d.cfg.model_dump()
    for k, v in d.trainable_state().items():
        torch.testing.assert_close(back.trainable_state()[k], v.bfloat16().float(), msg=k)
    # resume: the exact (fp32) weights come back; the verifier's frozen tensors a family
    # also serves (EAGLE-3's embedding) are not in the resume file, they come from the
    # verifier
    resume = load_file(str(path / "resume.safetensors"))
    trained_embedding = "embed_tokens.weight" in dict(d.named_parameters())  # P-EAGLE's
    assert ("w.embed_tokens.weight" in resume) == trained_embedding
    fresh = _draft(name, ver)
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(1.0)
    load_checkpoint(path, fresh, torch.optim.SGD(fresh.parameters(), lr=0.1))
    for k, v in d.state_dict().items():
        torch.testing.assert_close(fresh.state_dict()[k], v, msg=k, rtol=0, atol=0)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_drafting_step_refuses_another_familys_draft_in_one_line(name: str, ver: Path) -> None:
    """Every family's drafting step makes the one check (`families.base.drafts_with`):
    a draft of another family is a ConfigError naming the family and both classes."""
    other = _draft("eagle3" if name == "dflash" else "dflash", ver)  # never its own class
    fam = FAMILIES[name]
    for step in (fam.context, fam.drafting_context):
        with pytest.raises(ConfigError, match=f"the {name} family drafts with .*, got ") as e:
            step(other)
        assert type(other).__name__ in str(e.value) and "\n" not in str(e.value)


def test_a_checkpoint_of_another_family_is_refused(ver: Path, tmp_path: Path) -> None:
    d2 = _draft("dflash2", ver)
    path = save_checkpoint(
        tmp_path, d2, torch.optim.SGD(d2.parameters(), lr=0.1), {"step": 3},
        verifier_name_or_path=str(ver),
    )  # fmt: skip
    ds = _draft("dspark", ver)
    with pytest.raises(CheckpointError, match=r"a dflash2 draft's checkpoint.*dspark") as e:
        load_checkpoint(path, ds, None)
    assert "--draft-family dflash2" in str(e.value)
    # an edited config whose two family names disagree is refused too
    cfg = json.loads((path / "config.json").read_text())
    cfg["fanout"]["family"] = "dspark"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="edited inconsistently"):
        load_draft(path, ver)


# ---- one run, three families, as processes --------------------------------------------


def _fanout(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fanout.cli", *args],
        capture_output=True, text=True, env=ENV, timeout=600,
    )  # fmt: skip


def _steps(save: Path) -> list[int]:
    return [r["step"] for r in read_train_log(save)]


def test_four_families_on_one_stream_end_on_their_own_terms(tmp_path: Path) -> None:
    """One producer captures for every family (--capture-for); four trainers read the one
    stream and end on their own terms (steps, a stop and --resume, the stream's end); the
    four drafts decode in one eval run, lossless, EAGLE-3 at --num-speculative-tokens 2."""
    assets = tmp_path / "assets"
    _, _, verifier = build_tiny_assets(assets, generate_corpus(40, seed=0))
    run, drafts = tmp_path / "run", tmp_path / "drafts"
    procs = Procs(tmp_path / "logs")

    def trainer(name: str, *more: str) -> list[str]:
        return [
            "train", "--run-dir", str(run), "--consumer-id", name, "--draft-family", name,
            "--verifier-name-or-path", str(verifier), "--block-size", "4", "--num-layers",
            "1", "--max-anchors", "8", "--rows-per-step", "1", "--save-path",
            str(drafts / name), "--heartbeat-s", "0.5", "--checkpoint-every", "1000000000",
            *more,
        ]  # fmt: skip

    try:
        producer = procs.start(
            "producer", "produce", "--run-dir", str(run), "--verifier-name-or-path",
            str(verifier), "--tokenizer", str(assets / "tok"), "--data",
            str(assets / "chat.jsonl"), "--seq-len", "96", "--window-rows", "4",
            "--max-live-windows", "4", "--capture-for", "dflash,dflash2,dspark,eagle3",
            "--expected-consumers", "4", "--epochs", "2", "--workers", "1",
            "--heartbeat-s", "0.5", "--exit-when-idle-s", "0",
            "--cache-dir", str(tmp_path / "cache"),
        )  # fmt: skip
        dflash = procs.start("dflash", *trainer("dflash", "--max-steps", "6"))
        dflash2 = procs.start("dflash2", *trainer("dflash2", "--max-steps", "14"))
        dspark = procs.start("dspark", *trainer("dspark"))
        eagle3 = procs.start("eagle3", *trainer("eagle3", "--max-steps", "10"))

        # dflash2: stopped after a few steps, resumed, then on to its own --max-steps
        wait_for(lambda: _alive(dflash2) and len(_steps(drafts / "dflash2")) >= 3, 300, "steps")
        dflash2.proc.send_signal(signal.SIGINT)
        code, out = dflash2.finish(300)
        assert code == 0, out[-3000:]
        s = _summary(out)
        assert s["state"] == "stopped", s
        dflash2 = procs.start(
            "dflash2-resumed", *trainer("dflash2", "--max-steps", "14", "--resume")
        )

        results = {n: p.finish(600) for n, p in (("dflash", dflash), ("dflash2", dflash2),
                                                  ("dspark", dspark), ("eagle3", eagle3))}  # fmt: skip
        code, pout = producer.finish(600)
        assert code == 0, pout[-3000:]
    finally:
        procs.kill_all()

    info = json.loads((run / "stream.json").read_text())
    rows = info["num_rows"] * info["epochs"]
    assert rows > 14
    ends = {"dflash": 6, "dflash2": 14, "dspark": rows, "eagle3": 10}
    for name, (code, out) in results.items():
        assert code == 0, f"{name}: {out[-3000:]}"
        s = _summary(out)
        assert (s["steps"], s["state"]) == (ends[name], "finished"), (name, s)
        assert _steps(drafts / name) == list(range(1, ends[name] + 1)), name
    st = _status(run)
    assert {c["id"]: c["recorded_state"] for c in st["consumers"]} == {
        f"{n}:dp0": "finished" for n in ends
    }
    contract = json.loads((run / "contract.json").read_text())
    assert contract["store_last_hidden_states"] is True  # for DSpark's confidence head

    # each checkpoint is its family's; the four decode in one eval run, lossless
    for name in ends:
        ckpt = latest_checkpoint(drafts / name)
        assert ckpt is not None
        assert read_config(ckpt)["speculators_model_type"] == FAMILIES[name].speculators_model_type
    held = write_jsonl(tmp_path / "heldout.jsonl", generate_corpus(3, seed=99))
    r = _fanout(
        "eval", "--verifier-name-or-path", str(verifier), "--tokenizer", str(assets / "tok"),
        "--data", str(held), "--num-prompts", "3", "--max-new-tokens", "24",
        *[a for n in ends for a in ("--draft", str(drafts / n))],
        "--num-speculative-tokens", "2", "--json", str(tmp_path / "eval.json"),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads((tmp_path / "eval.json").read_text())
    assert rep["lossless"], rep["mismatches"]
    assert {n: d["family"] for n, d in rep["drafts"].items()} == {n: n for n in ends}
    assert rep["drafts"]["dspark"]["drafted_per_step"] == 4  # DSpark drafts the whole block
    assert rep["drafts"]["dflash"]["drafted_per_step"] == 3
    assert rep["drafts"]["eagle3"]["drafted_per_step"] == 2  # its chain: the flag's k
    assert len(rep["drafts"]["eagle3"]["per_position_acceptance"]) == 2
    # DSpark's confidence head: the length it would propose, reported beside τ
    assert 0 <= rep["drafts"]["dspark"]["proposed_length"] <= 4
    assert "its confidence head proposes" in r.stdout
    for name, d in rep["drafts"].items():  # bs as trained, as the JSON says; verify beside
        row = next(x for x in r.stdout.splitlines() if x.startswith(name + " "))
        assert row.split()[1:4] == [name, str(d["block_size"]), str(d["verify_width"])], row
    assert rep["drafts"]["eagle3"]["verify_width"] == 3  # k + 1
    assert rep["drafts"]["dspark"]["verify_width"] == rep["drafts"]["dspark"]["block_size"] + 1

    # resuming the DFlash save path as another family: one line, exit 1
    r = _fanout(*trainer("dflash"), "--resume", "--draft-family", "dspark")
    assert r.returncode == 1, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert "a dflash draft's checkpoint" in last and "dspark" in last, last
