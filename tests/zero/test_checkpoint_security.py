"""A checkpoint is data (issue 42): --resume never unpickles code. A pickle that names a class outside the allow-list is
refused with one line naming the file, before the model loads (the scan) and inside DeepSpeed's own reads of the files
(weights_only=True); a ``latest`` naming a missing tag or checkpoints that are all unreadable are refused before the
model loads too; the --select_every snapshot is read with weights_only=True whatever torch's default."""
from __future__ import annotations

import os
import shutil
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from elsa_ds.errors import ElsaError
from elsa_ds.files.output import check_output_dir
from elsa_ds.jobs.selection import Selector
from elsa_ds.jobs.training import RunState, run_state_problem, shared_state
from elsa_ds.zero import checkpoint, checkpoint_save, resume_load
from elsa_ds.zero.ds_config import DsConfig
from tests.conftest import ROOT, run_entry

FAST = ["--seqlen", "64", "--interval", "2", "--sparsity", "0.6", "--lr", "1e-3", "--lmda", "0.05", "--val_windows", "0",
        "--baseline", "none", "--micro_batch", "2", "--seed", "3", "--init_mask", "none", "--steps", "4",
        "--save_interval", "2", "--deepspeed", "ds_configs/zero3_offload.json"]
LOADING = "resolved ELSA config"  # printed once the checks passed, before the process group, the model and the engine


class WritesAFile:
    """Unpickled, it writes ``path``: the payload a crafted checkpoint would carry (os.system-free)."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (Path.write_text, (self.path, "pwned"))


def _plant(file: Path, payload: Path, **save) -> None:
    """The file as it was (our own, trusted here) plus a payload under a key nobody reads."""
    state = torch.load(file, weights_only=False) if file.exists() else {}
    state["elsa_payload"] = WritesAFile(payload)
    torch.save(state, file, **save)


# ---- the scan and the reader, on files written here ------------------------------------------------------------------
def _tag(ckpt: Path, name: str, *files: str) -> Path:
    (ckpt / name).mkdir(parents=True)
    for f in files:
        torch.save({"module": {"w": torch.ones(2)}, "global_steps": 2}, ckpt / name / f)
    return ckpt / name


def test_reader_refuses_a_pickle_that_runs_code(tmp_path):
    file, payload = tmp_path / "zero_pp_rank_0_mp_rank_00_model_states.pt", tmp_path / "pwned"
    torch.save({"module": {"w": torch.ones(2)}}, file)
    assert checkpoint.read_checkpoint_file(file, map_location="cpu")["module"]["w"].sum() == 2
    _plant(file, payload)
    with pytest.raises(checkpoint.UnsafeCheckpointError, match="getattr") as refused:
        checkpoint.read_checkpoint_file(file)
    assert str(file) in str(refused.value) and "\n" not in str(refused.value)
    assert not payload.exists()


def test_the_file_checked_is_the_file_read_and_never_a_link_or_a_fifo(tmp_path, monkeypatch):
    """The zip check and torch's read were two opens of one path: a file swapped in between them was read unchecked (a
    review's find, 2026-11-30). One handle now serves both; the path is opened without following a link, and a FIFO put
    where a checkpoint file was is refused, not waited on."""
    from elsa_ds.files import torch_files

    file, other = tmp_path / "zero_pp_rank_0_mp_rank_00_model_states.pt", tmp_path / "swapped.pt"
    torch.save({"module": {"w": torch.ones(2)}}, file)
    torch.save({"module": {"w": torch.full((2,), 7.0)}}, other)
    checked = torch_files.zip_problem

    def swap_after_the_check(fh):
        problem = checked(fh)
        os.replace(other, file)  # what the path names once the check has passed
        return problem

    monkeypatch.setattr(torch_files, "zip_problem", swap_after_the_check)
    assert checkpoint.read_checkpoint_file(file)["module"]["w"].tolist() == [1.0, 1.0]  # the file that was checked
    monkeypatch.undo()
    link, fifo = tmp_path / "linked_optim_states.pt", tmp_path / "fifo_optim_states.pt"
    link.symlink_to(file)
    os.mkfifo(fifo)
    for path, needle in ((link, "it is a link, which no checkpoint holds"), (fifo, "it is not a regular file")):
        for read in (checkpoint.read_checkpoint_file, checkpoint.unsafe_classes):
            with pytest.raises(checkpoint.UnsafeCheckpointError, match=needle):
                read(path)


def test_a_folder_swapped_for_a_link_after_the_checks_is_not_read_through(tmp_path):
    """O_NOFOLLOW sees only the file name's own link: a tag folder, the checkpoints folder itself or the best
    projection's snapshot folder swapped for a link after check_plain_tree was read through it (a trust leftover and a
    review's find, 2026-11-30). Where each folder really is is taken once (checked_root, itself never through a link),
    and every file DeepSpeed's reads, the scan and the snapshot's check and read open must lie inside it."""
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    ckpt, other = out / "checkpoints", elsewhere / "checkpoints"
    for folder in (ckpt, other):
        _tag(folder, "global_step2", "mp_rank_00_model_states.pt")
    path = ckpt / "global_step2" / "mp_rank_00_model_states.pt"
    root = checkpoint.checked_root(ckpt)
    assert checkpoint.read_checkpoint_file(path, root=root)["global_steps"] == 2  # inside: read

    def refused(*reads):
        for read in reads:
            with pytest.raises(checkpoint.UnsafeCheckpointError, match="outside .*a folder on its way became a link") as err:
                read()
            assert str(elsewhere) in str(err.value) and "\n" not in str(err.value)

    shutil.rmtree(ckpt / "global_step2")  # a tag folder swapped
    (ckpt / "global_step2").symlink_to(other / "global_step2", target_is_directory=True)
    assert checkpoint.read_checkpoint_file(path)["global_steps"] == 2  # no root given: what O_NOFOLLOW alone allowed
    refused(lambda: checkpoint.read_checkpoint_file(path, root=root), lambda: checkpoint.unsafe_classes(path, root))
    ckpt.rename(out / "was_checkpoints")  # the checkpoints folder itself swapped, once its root was taken
    ckpt.symlink_to(other, target_is_directory=True)
    refused(lambda: checkpoint.read_checkpoint_file(path, root=root))
    with pytest.raises(checkpoint.UnsafeCheckpointError, match="it is a link"):  # a root taken now refuses the link
        checkpoint.checked_root(ckpt)
    snapshots, planted = out / "best_projection", elsewhere / "best_projection"
    for folder in (snapshots, planted):
        folder.mkdir()
        torch.save({"w": torch.ones(2)}, folder / "rank0.pt")
    snapshot_root = checkpoint.checked_root(snapshots)
    checkpoint.check_file(snapshots / "rank0.pt", "the best projection's snapshot", snapshot_root)
    snapshots.rename(out / "was_best_projection")  # the snapshot folder swapped after the resume's scan
    snapshots.symlink_to(planted, target_is_directory=True)
    with pytest.raises(ElsaError, match="outside"):
        checkpoint.check_file(snapshots / "rank0.pt", "the best projection's snapshot", snapshot_root)
    refused(lambda: checkpoint.read_checkpoint_file(snapshots / "rank0.pt", root=snapshot_root))


class OneRank:
    """The Comm ``load_latest`` and its root check use, for one rank: its sums are its own."""

    world_size = 1

    @staticmethod
    def all_reduce_sum(t):
        return t


def test_the_root_the_resume_checked_is_the_one_loaded_from_and_a_moved_or_gone_one_stops_every_rank(tmp_path):
    """check_resume and load_latest took the folder's real place each on its own, so a parent swapped between them
    had DeepSpeed read files never scanned; and one rank's refusal there left the others in the load's all-reduce (a
    review's finds, 2026-11-30). load_latest now takes check_resume's, says when the folder moved, and refuses together."""
    out = tmp_path / "out"
    ckpt = out / "checkpoints"
    _tag(ckpt, "global_step2", "mp_rank_00_model_states.pt")
    (ckpt / "latest").write_text("global_step2")
    checkpoint.check_resume(ckpt)
    assert resume_load._load_root(ckpt, OneRank()) == ckpt.resolve()
    out.rename(tmp_path / "scanned")  # the scanned run moved away, another put in its place
    _tag(ckpt, "global_step2", "mp_rank_00_model_states.pt")
    with pytest.raises(checkpoint.UnsafeCheckpointError, match="not the folder whose files were checked before loading"):
        resume_load._load_root(ckpt, OneRank())
    shutil.rmtree(out)
    with pytest.raises(ElsaError, match="--resume: cannot read .*checkpoints"):  # gone: one line, not a traceback
        resume_load._load_root(ckpt, OneRank())
    (tmp_path / "planted").mkdir()
    snapshots = tmp_path / "best_projection"
    snapshots.symlink_to(tmp_path / "planted", target_is_directory=True)  # a link left where a fresh run saves its best
    with pytest.raises(checkpoint.UnsafeCheckpointError, match="^--select_every: refusing .*it is a link"):
        checkpoint.checked_root(snapshots, "--select_every")


class RewritesAStage:
    """Unpickled, it sets attributes on ZeroStageEnum's member 3, an object DeepSpeed shares process-wide (BUILD)."""

    def __reduce__(self):
        from deepspeed.runtime.zero.config import ZeroStageEnum

        return (ZeroStageEnum, (3,), {"_value_": 1, "elsa_payload": "pwned"})


def test_the_reader_never_lets_a_pickle_set_attributes_on_deepspeeds_enum(tmp_path):
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    stage = ZeroStageEnum(3)
    before = dict(vars(stage))
    genuine, altered = tmp_path / "genuine_optim_states.pt", tmp_path / "altered_optim_states.pt"
    torch.save({"zero_stage": stage, "loss_scaler": LossScaler(1.0)}, genuine)
    loaded = checkpoint.read_checkpoint_file(genuine)
    assert loaded["zero_stage"] is stage and loaded["loss_scaler"].cur_scale == 1.0
    assert checkpoint.unsafe_classes(genuine) == []
    torch.save({"zero_stage": RewritesAStage()}, altered)
    with pytest.raises(checkpoint.UnsafeCheckpointError, match="ZeroStageEnum") as refused:
        checkpoint.read_checkpoint_file(altered)
    assert str(altered) in str(refused.value) and "\n" not in str(refused.value)
    assert dict(vars(stage)) == before and stage.value == 3


class PickledByName:
    """An object pickled as ``getattr(owner, name)``: how Python 3.11.2 pickles an enum member (by name)."""

    def __init__(self, owner: object, name: str):
        self.owner, self.name = owner, name

    def __reduce__(self):
        return getattr, (self.owner, self.name)


def test_a_stage_pickled_by_name_as_python_3_11_2_writes_it_is_read_and_nothing_else_through_getattr(tmp_path):
    """An audit of the dependency ranges (2026-12-07): Python 3.11.2 (Debian 12's) pickles ``ZeroStageEnum`` members by
    name, ``getattr(ZeroStageEnum, 'weights')``, and every resume there was refused as "not written by elsa_ds or
    altered". That form is read for the enum and a member's name alone; any other getattr is refused, nothing run."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    written = tmp_path / "by_name_optim_states.pt"
    torch.save({"zero_stage": PickledByName(ZeroStageEnum, "weights")}, written)
    assert checkpoint.unsafe_classes(written) == []
    assert checkpoint.read_checkpoint_file(written)["zero_stage"] is ZeroStageEnum.weights
    for owner, name in [(ZeroStageEnum, "__class__"), (ZeroStageEnum, "_missing_"), (LossScaler, "__init__")]:
        torch.save({"zero_stage": PickledByName(owner, name)}, written)
        with pytest.raises(checkpoint.UnsafeCheckpointError, match="getattr"):
            checkpoint.read_checkpoint_file(written)


@pytest.mark.parametrize("protocol", [2, 4])
def test_scan_refuses_every_tag_a_resume_may_load(tmp_path, protocol):
    """The tags from ``latest`` down are scanned, an older one too (a resume falls back to it); protocol 4's opcodes
    (which torch.save never writes) are refused as well, not taken for an unreadable file."""
    ckpt, payload = tmp_path / "checkpoints", tmp_path / "pwned"
    _tag(ckpt, "global_step4", "model_states.pt")
    _plant(_tag(ckpt, "global_step2", "model_states.pt") / "model_states.pt", payload, pickle_protocol=protocol)
    (ckpt / "latest").write_text("global_step4")
    with pytest.raises(checkpoint.UnsafeCheckpointError, match="global_step2/model_states.pt"):
        checkpoint.check_resume(ckpt)
    assert not payload.exists()


def test_scan_refuses_a_latest_without_its_tag_and_checkpoints_that_are_all_unreadable(tmp_path):
    ckpt = tmp_path / "checkpoints"
    _tag(ckpt, "global_step2", "model_states.pt", "optim_states.pt")
    _tag(ckpt, "global_step9", "model_states.pt")  # newer than latest: never published, never tried
    (ckpt / "latest").write_text("global_step4")
    with pytest.raises(ElsaError, match="names 'global_step4', which is not a checkpoint.*start over with --overwrite in "
                                        "place of --resume"):  # not "without --resume": refused as not empty (an audit)
        checkpoint.check_resume(ckpt)
    (ckpt / "latest").write_text("global_step2")
    checkpoint.check_resume(ckpt)
    truncated = ckpt / "global_step2" / "optim_states.pt"
    truncated.write_bytes(truncated.read_bytes()[:100])
    with pytest.raises(ElsaError, match="no checkpoint in .* is readable .*global_step2: optim_states.pt"):
        checkpoint.check_resume(ckpt)


@pytest.mark.parametrize("section,needle", [({"load_universal": True}, "load_universal"),
                                            ({"checkpoint_serialization": False}, "checkpoint_serialization")])
def test_checkpoint_settings_that_bypass_the_reader_are_refused(section, needle):
    with pytest.raises(ElsaError, match=needle):
        checkpoint.check_supported(DsConfig({"zero_optimization": {"stage": 3}, "checkpoint": section}))
    with pytest.raises(ElsaError, match="pipeline_loading_checkpoint"):  # ranks send to each other inside the load
        checkpoint.check_supported(DsConfig({"zero_optimization": {"stage": 3, "pipeline_loading_checkpoint": True}}))
    checkpoint.check_supported(DsConfig({"zero_optimization": {"stage": 3}}))


def test_publishing_never_writes_through_a_link_nor_prunes_the_tag_it_published(tmp_path):
    """A copied checkpoint folder may hold links: at the temporary name ``latest`` is written under, to a file outside, a tag to a folder outside. Publishing
    replaces the link, never writes its target; removing a tag removes the link, never what it points at. A tag newer
    than the one published (a killed run's, never published) does not count against --keep_checkpoints: with keep 1 it
    once pushed out the tag ``latest`` had just named, leaving no checkpoint to resume."""
    ckpt, outside = tmp_path / "checkpoints", tmp_path / "outside"
    outside.mkdir()
    victim = outside / "victim.txt"
    victim.write_text("keep me")
    (outside / "shard.pt").write_text("keep me too")
    for tag in ("global_step10", "global_step15", "global_step20"):
        _tag(ckpt, tag, "model_states.pt")
    (ckpt / "global_step30").symlink_to(outside, target_is_directory=True)
    (ckpt / "latest").write_text("global_step10")
    temp = ckpt / f".latest.{os.getpid()}.tmp"  # files/io.write_atomic's name for it, in this process
    temp.symlink_to(victim)
    checkpoint_save.publish_latest(ckpt, "global_step15", keep=1)
    assert (ckpt / "latest").read_text() == "global_step15" and not (ckpt / "latest").is_symlink()
    assert not temp.exists() and not temp.is_symlink() and victim.read_text() == "keep me"
    assert checkpoint.resume_order(ckpt) == ["global_step15"]
    assert sorted(p.name for p in ckpt.iterdir()) == ["global_step15", "latest"]
    assert sorted(p.name for p in outside.iterdir()) == ["shard.pt", "victim.txt"]
    (ckpt / "global_step20").symlink_to(outside, target_is_directory=True)
    (ckpt / "zero_to_fp32.py").symlink_to(victim)  # DeepSpeed copies its script there with shutil.copyfile
    checkpoint_save.clear_for_save(ckpt, "global_step20")  # rank 0, before every rank writes that tag
    assert not (ckpt / "global_step20").exists() and not (ckpt / "zero_to_fp32.py").exists()
    assert (outside / "shard.pt").read_text() == "keep me too" and victim.read_text() == "keep me"


def test_a_tag_that_cannot_be_removed_is_named_not_kept_in_silence(tmp_path, monkeypatch, caplog):
    """An audit (OS limits and permissions, 2026-12-07): a tag the user cannot delete (a read-only folder) stayed beside
    the --keep_checkpoints newest without a word (hundreds of GB at 27B). Now a warning names it and why. As root a
    permission does not stop a removal, so the refusal the folder's owner would get is raised for its one file."""
    ckpt = tmp_path / "checkpoints"
    for tag, name in (("global_step10", "blocked.pt"), ("global_step15", "model_states.pt"), ("global_step20", "model_states.pt")):
        _tag(ckpt, tag, name)
    (ckpt / "latest").write_text("global_step15")
    unlink = os.unlink

    def refused(path, *args, **kwargs):
        if os.fspath(path).endswith("blocked.pt"):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", refused)
    with caplog.at_level("WARNING", logger="elsa_ds"):
        checkpoint_save.publish_latest(ckpt, "global_step20", keep=1)
    assert sorted(p.name for p in ckpt.iterdir()) == ["global_step10", "global_step20", "latest"]
    said = [r.getMessage() for r in caplog.records if "could not be removed" in r.getMessage()]
    assert len(said) == 1 and str(ckpt / "global_step10") in said[0] and "Permission denied" in said[0], caplog.text


def test_a_failed_save_reads_latest_as_data_never_through_a_link(tmp_path):
    """After a failed save, rank 0 keeps the tag only where ``latest`` names it: ``latest`` is opened without following a
    link (one naming the tag elsewhere does not keep it) and at most a tag's name is read (an audit: a link to a file of
    any size was read whole)."""
    ckpt, outside = tmp_path / "checkpoints", tmp_path / "outside"
    ckpt.mkdir()
    outside.mkdir()
    _tag(ckpt, "global_step2", "model_states.pt")
    _tag(ckpt, "global_step4", "model_states.pt")
    (outside / "latest").write_text("global_step4")
    (ckpt / "latest").symlink_to(outside / "latest")
    checkpoint_save.discard_unpublished_tag(ckpt, "global_step4")
    assert not (ckpt / "global_step4").exists() and (ckpt / "global_step2").is_dir()
    (ckpt / "latest").unlink()
    (ckpt / "latest").write_text("global_step4" + " " * checkpoint.LATEST_BYTES)  # more than a name: none published
    assert checkpoint_save.published_tag(ckpt) is None
    (ckpt / "latest").write_text("global_step2\n")
    assert checkpoint_save.published_tag(ckpt) == "global_step2"


def test_selection_snapshot_is_read_as_data_whatever_torchs_default(tmp_path, monkeypatch):
    """torch >= 2.6 defaults to weights_only=True, but TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD (or an older torch) turns an
    implicit default off: the snapshot must be read with weights_only=True explicitly."""
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    payload = tmp_path / "pwned"
    selector = Selector(every=1, patience=0, directory=tmp_path / "best", rank=0,
                        record={"curve": [], "best": {"step": 2, "ppl": 10.0}, "since_best": 0, "stopped_at": None})
    selector.directory.mkdir()
    _plant(selector.directory / "rank0.pt", payload)
    with pytest.raises(checkpoint.UnsafeCheckpointError, match="rank0.pt"):
        selector.choose(None, final_ppl=None, final_step=4)  # the snapshot wins: it is read before the shards are touched
    assert not payload.exists()
    with pytest.raises(checkpoint.UnsafeCheckpointError, match="rank0.pt"):  # and a resume scans it before any step
        selector.resumed(selector.record)


# ---- a real run's checkpoint, resumed --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory, tiny_model_dir, text_dir) -> tuple[Path, list[str]]:
    """A finished 4-step run whose checkpoint (global_step2) is published; the args that resume it."""
    out = tmp_path_factory.mktemp("checkpointed") / "o"
    args = [*FAST, "--model", str(tiny_model_dir), "--dataset", str(text_dir)]
    run_entry("prune.py", [*args, "--output_dir", str(out)])
    assert (out / "checkpoints" / "latest").read_text() == "global_step2"
    return out, args


@pytest.fixture(scope="module")
def checkpointed_on_two_ranks(tmp_path_factory, tiny_model_dir, text_dir) -> tuple[Path, list[str]]:
    """A finished 6-step run of 2 ranks with two checkpoints kept (global_step2, global_step4 in latest); the args."""
    out = tmp_path_factory.mktemp("checkpointed_two") / "o"
    args = [*FAST, "--steps", "6", "--keep_checkpoints", "2", "--model", str(tiny_model_dir), "--dataset", str(text_dir)]
    run_entry("prune.py", [*args, "--output_dir", str(out)], ranks=2)
    assert (out / "checkpoints" / "latest").read_text() == "global_step4" and (out / "checkpoints" / "global_step2").is_dir()
    return out, args


@pytest.mark.integration
@pytest.mark.parametrize("damage", ["truncated", "missing", "altered", "partition", "loop state", "z"])
def test_a_newest_tag_damaged_on_one_rank_falls_back_or_is_refused_on_every_rank(checkpointed_on_two_ranks, tmp_path, damage):
    """A walk (2026-12-02): rank 1's shard of the newest tag truncated, missing or altered left rank 0 inside DeepSpeed's
    collective load and rank 1 in the agreement after it, both waiting for good (deaf to Ctrl-C and SIGTERM). Each rank
    now reads its own files before the load and the ranks agree: the previous tag, or one refusal. A second walk: a
    shard that reads well but fails inside DeepSpeed's load on rank 1 alone (its optimizer partition of another size)
    hung them the same way (the ranks now agree before the load's first collective too), and rank 1's loop state
    altered alone (its λ) trained on with 10x λ on one partition (the ranks' states are compared: one refusal)."""
    out, args = _copy(checkpointed_on_two_ranks, tmp_path)
    tag = out / "checkpoints" / "global_step4"
    (optim,) = tag.glob("*zero_pp_rank_1_*optim_states.pt")
    (model,) = tag.glob("*zero_pp_rank_1_*model_states.pt")
    if damage == "truncated":
        optim.write_bytes(optim.read_bytes()[: optim.stat().st_size // 2])
    elif damage == "missing":
        optim.unlink()
    elif damage == "altered":
        _altered(model, lambda s: s.__setitem__("x", torch.zeros(1).expand(10**6)))
    elif damage == "partition":
        _altered(optim, lambda s: s["optimizer_state_dict"]["fp32_flat_groups"].__setitem__(0, torch.zeros(10)))
    elif damage == "z":  # refused inside DeepSpeed's load on rank 1, while rank 0 agrees before the load's collective
        _altered(optim, _shrink_z)
    else:
        _altered(model, lambda s: s[checkpoint.CLIENT_KEY].__setitem__("lam", 10 * s[checkpoint.CLIENT_KEY]["lam"]))
    proc = run_entry("prune.py", args, ranks=2, check=False, timeout=420)
    text = proc.stdout + proc.stderr
    assert "Traceback" not in text, text[-3000:]
    if damage in ("altered", "loop state", "z"):
        needle = {"altered": "claims 4,000,000 bytes over a storage of 4", "loop state": "loop states differ",
                  "z": "admm_z holds 10"}[damage]
        assert proc.returncode != 0 and needle in proc.stderr, text[-3000:]
        assert not (out / "model.safetensors").exists()
    else:
        assert proc.returncode == 0 and f"resumed from {out / 'checkpoints' / 'global_step2'}" in proc.stdout, text[-3000:]


def _copy(checkpointed, tmp_path) -> tuple[Path, list[str]]:
    """The run's output as an interrupted run leaves it (no exported model), and the args that resume it."""
    source, args = checkpointed
    out = tmp_path / "o"
    shutil.copytree(source, out)
    for f in out.glob("*.safetensors"):
        f.unlink()
    return out, [*args, "--output_dir", str(out), "--resume"]


def _refused(args: list[str], *needles: str, env: dict[str, str] | None = None) -> str:
    """Exit 2, no traceback, one error line holding ``needles``; returns everything the run printed."""
    proc = run_entry("prune.py", args, check=False, timeout=600, env=env)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in text, text[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("elsa_ds: error")]
    assert len(errors) == 1, text[-3000:]
    for needle in needles:
        assert needle in errors[0], errors[0]
    return text


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["model_states", "optim_states"])
def test_a_pickle_in_a_checkpoint_is_refused_before_the_model_loads(checkpointed, tmp_path, kind):
    out, args = _copy(checkpointed, tmp_path)
    (file,) = (out / "checkpoints" / "global_step2").glob(f"*{kind}.pt")
    payload = tmp_path / "pwned"
    _plant(file, payload)
    text = _refused(args, "refusing checkpoint file", str(file), "getattr")
    assert LOADING not in text and not payload.exists()


@pytest.mark.integration
def test_deepspeeds_own_reads_of_the_files_refuse_it_too(checkpointed, tmp_path):
    """The scan skipped (test-only sitecustomize): DeepSpeed reads the files through elsa_ds's weights-only reader, which
    refuses the planted pickle in the optimizer states (read after the model states) without running it."""
    out, args = _copy(checkpointed, tmp_path)
    (file,) = (out / "checkpoints" / "global_step2").glob("*optim_states.pt")
    payload = tmp_path / "pwned"
    _plant(file, payload)
    fixture = ROOT / "tests" / "fixtures" / "skip_resume_scan"
    env = {"ELSA_TEST_SKIP_RESUME_SCAN": "1",
           "PYTHONPATH": os.pathsep.join([str(fixture), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    text = _refused(args, "refusing checkpoint file", str(file), "getattr", env=env)
    assert LOADING in text and not payload.exists()  # the engine was built: the refusal came from the load


@pytest.mark.integration
@pytest.mark.parametrize("reader", ["scan", "deepspeed"])
def test_a_checkpoint_file_that_would_unpack_to_far_more_than_its_size_is_refused(checkpointed, tmp_path, reader):
    """The optimizer states rewritten with their pickle deflated (64 MiB more unpacked) behind a decoy directory that
    Python's zipfile reads as stored: refused by the scan before the model loads, and by elsa_ds's reader inside
    DeepSpeed's own load when the scan is skipped (test-only sitecustomize), never unpacked by torch."""
    from tests.test_crafted_sizes import _rewritten, _with_decoy_directory

    out, args = _copy(checkpointed, tmp_path)
    (file,) = (out / "checkpoints" / "global_step2").glob("*optim_states.pt")
    file.write_bytes(_with_decoy_directory(_rewritten(file, tmp_path / "deflated.pt", 64 * 2**20)))
    fixture = ROOT / "tests" / "fixtures" / "skip_resume_scan"
    env = {"ELSA_TEST_SKIP_RESUME_SCAN": "1",
           "PYTHONPATH": os.pathsep.join([str(fixture), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    text = _refused(args, "refusing checkpoint file", str(file), "does not end where its end records start",
                    env=env if reader == "deepspeed" else None)
    assert (LOADING in text) == (reader == "deepspeed")


@pytest.mark.integration
def test_a_latest_naming_a_missing_tag_is_refused_before_the_model_loads(checkpointed, tmp_path):
    out, args = _copy(checkpointed, tmp_path)
    (out / "checkpoints" / "latest").write_text("global_step6")
    text = _refused(args, "latest names 'global_step6', which is not a checkpoint", "global_step2")
    assert LOADING not in text


@pytest.mark.integration
def test_unreadable_checkpoints_are_refused_before_the_model_loads(checkpointed, tmp_path):
    out, args = _copy(checkpointed, tmp_path)
    for f in (out / "checkpoints").glob("global_step*/*optim_states.pt"):
        f.write_bytes(f.read_bytes()[:100])  # a crash mid-write
    text = _refused(args, "no checkpoint in", "is readable", "global_step2")
    assert LOADING not in text


@pytest.mark.integration
def test_a_genuine_checkpoint_still_resumes(checkpointed, tmp_path):
    """... also when the folder is a hard-link copy (`cp -al`) of another: the other names stay as they were."""
    out, args = _copy(checkpointed, tmp_path)
    snapshot = tmp_path / "snapshot"
    shutil.copytree(out, snapshot)
    for name in ("checkpoints/zero_to_fp32.py", "monitor/elsa/loss.csv"):  # DeepSpeed rewrites one, appends to the other
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / name).write_text("the snapshot's")
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).unlink(missing_ok=True)
        os.link(snapshot / name, out / name)
    proc = run_entry("prune.py", args)
    assert "resumed from" in proc.stdout and "continuing at step 2" in proc.stdout, proc.stdout[-3000:]
    assert (out / "model.safetensors").exists()
    assert all((snapshot / name).read_text() == "the snapshot's" for name in ("checkpoints/zero_to_fp32.py", "monitor/elsa/loss.csv"))
    assert os.stat(out / "monitor" / "elsa" / "loss.csv").st_nlink == 1


@pytest.mark.integration
def test_an_output_folder_named_like_a_glob_pattern_resumes_its_own_checkpoint(checkpointed, tmp_path):
    """An audit: DeepSpeed globs the model states' path, so an --output_dir under "[x]" matched nothing (no loadable
    checkpoint: such a run saved checkpoints it could never resume) or a sibling "x"'s run (refused as a link)."""
    _copy(checkpointed, tmp_path / "x")
    out, args = _copy(checkpointed, tmp_path / "[x]")
    proc = run_entry("prune.py", args)
    assert f"resumed from {out / 'checkpoints' / 'global_step2'}" in proc.stdout, proc.stdout[-3000:]
    assert "continuing at step 2" in proc.stdout and (out / "model.safetensors").exists()


# ---- a folder handed over: links, special files and altered state (an audit's finds, 2026-11-29) ---------------------
@pytest.mark.parametrize("where", ["checkpoints", "tag", "file", "latest fifo", "monitor", "side folder"])
def test_a_resumed_folder_with_a_link_or_a_fifo_is_refused_before_anything_in_it_is_read(tmp_path, where):
    """A link would send the resume's reads, DeepSpeed's writes and the old tags' removal outside the folder; a FIFO at
    `latest` hung the job while it held the output's lock."""
    out, elsewhere = tmp_path / "o", tmp_path / "elsewhere"
    ckpt = out / "checkpoints"
    _tag(ckpt, "global_step2", "model_states.pt")
    (ckpt / "latest").write_text("global_step2")
    elsewhere.mkdir()
    (elsewhere / "precious.txt").write_text("keep")
    target = {"checkpoints": ckpt, "tag": ckpt / "global_step2", "file": ckpt / "global_step2" / "model_states.pt",
              "monitor": out / "monitor", "side folder": tmp_path / ".o.best_projection"}.get(where)
    if where == "latest fifo":
        (ckpt / "latest").unlink()
        os.mkfifo(ckpt / "latest")
        target = ckpt / "latest"
    else:
        if target.exists():
            shutil.move(target, elsewhere / target.name)
        target.symlink_to(elsewhere / target.name if (elsewhere / target.name).exists() else elsewhere)
    with pytest.raises(ElsaError, match="FIFO" if where == "latest fifo" else "symbolic link") as refused:
        check_output_dir(out, overwrite=False, resume=True)
    assert str(target) in str(refused.value) and "\n" not in str(refused.value)
    assert (elsewhere / "precious.txt").read_text() == "keep"


def test_a_handed_over_tree_is_walked_without_recursion_and_a_deep_one_refused(tmp_path):
    """A walk (2026-12-02): 1,500 nested folders in a resumed run's checkpoints were a RecursionError (Python 3.11's
    os.walk recurses); the walk is a loop that sees what os.walk sees, and refuses a tree deeper than any run writes."""
    from elsa_ds.files import handed

    ok = tmp_path / "ok"
    (ok / "a" / "b").mkdir(parents=True)
    (ok / "a" / "f").write_text("x")
    (ok / "g").write_text("y")
    assert sorted((r, sorted(d), sorted(f)) for r, d, f in handed.walk(ok, "x")) == \
        sorted((r, sorted(d), sorted(f)) for r, d, f in os.walk(ok))
    handed.check_plain_tree(ok, "the checkpoints")
    for depth in (handed.MAX_DEPTH + 2, 1500):
        deep = folders = tmp_path / f"deep{depth}"
        for _ in range(depth + 1):  # os.makedirs and pytest's clean-up recurse too: a loop each way
            folders.mkdir()
            folders = folders / "d"
        with pytest.raises(ElsaError, match=f"the checkpoints nest folders more than {handed.MAX_DEPTH} deep"):
            handed.check_plain_tree(deep, "the checkpoints")
        while folders != deep:
            folders = folders.parent
            folders.rmdir()


def test_a_fingerprints_odd_values_are_named_not_a_traceback():
    """A walk: a fingerprint file's "~nosuchuser/m", a name too long for the system, a value nested past Python's stack
    were tracebacks (RuntimeError, OSError, RecursionError) in the refusal's own text."""
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    refusal = checkpoint.resume_changes({"model": "~nosuchuser/m", "dataset": "x" * 5000, "sparsity": deep},
                                        {"model": "m", "dataset": "d", "sparsity": 0.6})
    assert "model '~nosuchuser/m' vs 'm'" in refusal and "sparsity [[[[...]]]] vs 0.6" in refusal and len(refusal) < 2000


def test_an_altered_loop_state_is_named_not_a_traceback():
    """The client state DeepSpeed hands back: every field with its type, the RNG as elsa_ds saves it."""
    good = {**asdict(RunState(fingerprint={"sparsity": 0.6}, computed_in={"dense": "float32 on the engine"})),
            "rng": checkpoint.rng_state()}
    assert run_state_problem(good) is None
    older = {k: v for k, v in good.items() if k not in ("selection", "baseline_ppl", "computed_in")}  # an older elsa_ds's
    assert run_state_problem(older) is None
    for change, needle in [({"next_step": "3"}, "next_step"), ({"rng": {"torch": torch.zeros(3)}}, "rng"),
                           ({"losses": [1.0, "x"]}, "losses"), ({"extra": 1}, "keys"),
                           ({"computed_in": {"dense": 3}}, "computed_in"), ({"computed_in": {"d": "x" * 201}}, "computed_in")]:
        assert needle in run_state_problem({**good, **change})
    assert "not a dict" in run_state_problem(["a", "list"])
    deep: list = []
    for _ in range(100_000):  # a walk: nested past Python's stack, it failed in the refusal's own text
        deep = [deep]
    assert "fingerprint" in run_state_problem({**good, "fingerprint": {"sparsity": deep}})
    assert "history" in run_state_problem({**good, "history": [{"step": [[[1]]]}]})
    projection = {"step": 4, "loss": 3.2, "lambda": 0.01, "residual": 0.1, "mask_flip_frac": 0.0,
                  "admm_state_bytes_per_param": 8.0, "final": False, "lambda_range": [0.01, 0.02]}
    curve = [{"step": 4, "ppl": 30.0}, {"step": 8, "ppl": 29.0, "final": True}]
    selection = {"curve": curve, "best": curve[0], "since_best": 1, "stopped_at": None}
    assert run_state_problem({**good, "history": [projection], "selection": selection}) is None
    older_selection = {k: v for k, v in selection.items() if k != "stopped_at"}
    assert run_state_problem({**good, "selection": older_selection}) is None
    for history in ([{}], [{**projection, "final": "no"}], [{**projection, "residual": None}],  # an audit: KeyError 'final'
                    [{**projection, "step": -1}], [{**projection, "lambda_range": [1.0]}]):
        assert "history" in run_state_problem({**good, "history": history}), history
    for change in ({"curve": {}}, {"curve": [{}]}, {"curve": [{"step": 1, "ppl": "low"}]}, {"best": {"step": 1}},
                   {"best": {"step": 1, "ppl": 2.0, "x": 1}}, {"since_best": -1}, {"stopped_at": "4"}, {"chosen": []},
                   {"extra": 1}):  # an audit: a curve of {} failed at the next score, AttributeError after a step had run
        assert "selection" in run_state_problem({**good, "selection": {**selection, **change}}), change
    other_rank = {**good, "step_times": [9.0], "rng": checkpoint.rng_state()}  # each rank's own: not compared
    assert shared_state(other_rank) == shared_state(good) != shared_state({**good, "lam": 1.0})
    del good["fingerprint"]
    assert "keys" in run_state_problem(good)


def _altered(path: Path, change) -> None:
    state = torch.load(path, weights_only=False)  # our own file, trusted here
    change(state)
    torch.save(state, path)


@pytest.mark.integration
@pytest.mark.parametrize("what", ["client state", "loss scaler", "admm state"])
def test_an_altered_checkpoint_is_refused_in_one_line(checkpointed, tmp_path, what):
    """Tensors and allowed classes only, but not what elsa_ds wrote: the loop's state without its fingerprint, a loss
    scaler replaced by a dict, z of the wrong size: one line each (they were tracebacks, the last two after training
    had started)."""
    out, args = _copy(checkpointed, tmp_path)
    tag = out / "checkpoints" / "global_step2"
    model, optim = next(tag.glob("*model_states.pt")), next(tag.glob("*optim_states.pt"))
    if what == "client state":
        _altered(model, lambda s: s[checkpoint.CLIENT_KEY].pop("fingerprint"))
        _refused(args, "loop state", "not what elsa_ds writes")
    elif what == "loss scaler":
        _altered(optim, lambda s: s["optimizer_state_dict"].__setitem__("loss_scaler", {"cur_scale": 1.0}))
        _refused(args, "loss scaler", "not what elsa_ds writes")
    else:
        _altered(optim, _shrink_z)
        _refused(args, "ADMM state does not fit", "admm_z holds 10")


def _shrink_z(state: dict) -> None:
    (st,) = [v for v in state["optimizer_state_dict"]["optimizer_state_dict"]["state"].values() if "admm_z" in v]
    st["admm_z"] = torch.zeros(10, dtype=st["admm_z"].dtype)


@pytest.mark.integration
def test_a_resume_through_a_linked_checkpoint_folder_writes_nothing_there(checkpointed, tmp_path):
    """The audit's case: `checkpoints` a link to another run's folder; the resume wrote its tag and `latest` there and
    pruned that folder's older tags. Refused now, before the model loads; the other folder as it was."""
    out, args = _copy(checkpointed, tmp_path)
    other = tmp_path / "other_run_checkpoints"
    shutil.move(out / "checkpoints", other)
    (other / "global_step1").mkdir()
    (other / "global_step1" / "precious.txt").write_text("keep")
    before = sorted(str(p.relative_to(other)) for p in other.rglob("*"))
    (out / "checkpoints").symlink_to(other)
    text = _refused(args, "symbolic link", str(out / "checkpoints"))
    assert LOADING not in text and sorted(str(p.relative_to(other)) for p in other.rglob("*")) == before
