"""Shipping the real model to a GPU machine and the budget curve's runner (bench/device/ship.py, quality.sh, curve.py),
rehearsed end to end on a tiny stand-in: a random 2-layer Gemma-3 GGUF (tests/test_bench_gemma3.py's), its tokenizer and
stand-in corpora packed, cut into parts, each part put into a scratch folder by the real command line as the device calls
would, joined, checked, built into a model folder, then two cells run by quality.sh's dry run on CPU."""
from __future__ import annotations

import json
import math
import os
import random
import re
import subprocess
import sys
import tarfile
import time
from dataclasses import replace
from pathlib import Path

import pytest

from bench.device import curve, curve_report, estimate, ship
from bench.models.gemma3 import GgufSource, build, file_sha256
from elsa_ds.loss import LOSS_ENV
from elsa_ds.step_profile import SPANS
from elsa_ds.settings.config import DEMO_MODEL_DIR
from tests.test_bench_gemma3 import WORDS, write_tiny_gguf

ROOT = Path(__file__).resolve().parent.parent
SHIP = [sys.executable, str(ROOT / "bench" / "device" / "ship.py")]


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory) -> dict:
    """The tiny GGUF, a tokenizer folder built from it, and corpora in the layout ship.py packs."""
    root = tmp_path_factory.mktemp("stand_in")
    gguf = root / "tiny-gemma3.gguf"
    write_tiny_gguf(gguf)
    sha = file_sha256(gguf)

    def assemble(target: Path) -> Path:
        target.write_bytes(gguf.read_bytes())
        return target

    tokenizer = build(root / "built", GgufSource(gguf.name, sha, assemble), say=lambda _: None)
    rng, words = random.Random(0), [w.lstrip("▁") for w in WORDS]
    for name, files in ship.CORPORA.items():
        (root / "corpora" / name).mkdir(parents=True)
        for f in files:
            lines = [json.dumps({"text": " ".join(rng.choice(words) for _ in range(150))}) for _ in range(30)]
            (root / "corpora" / name / f).write_text("{}" if f == "corpus.json" else "\n".join(lines) + "\n")
    terms = root / "GEMMA_TERMS.html"
    terms.write_text("<p>terms</p>")
    return {"gguf": gguf, "sha": sha, "tokenizer": tokenizer, "corpora": root / "corpora", "terms": terms}


@pytest.fixture(scope="module")
def packed(stand_in, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("ship")
    manifest = ship.pack(stand_in["gguf"], stand_in["sha"], stand_in["tokenizer"], stand_in["corpora"], stand_in["terms"],
                         out, part_mib=0.05, results=out / "no_cells_yet.jsonl")
    return out, manifest


def put(index: int, src: Path, dest: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*SHIP, "put", str(index), "--ship", str(src), "--dest", str(dest)], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


def test_pack_cuts_parts_that_rejoin_to_the_payload_and_plans_one_call_each(packed):
    out, manifest = packed
    parts = manifest["parts"]
    assert len(parts) >= 3 and all(p["bytes"] <= manifest["part_bytes"] for p in parts)
    assert sum(p["bytes"] for p in parts) == manifest["payload_bytes"]
    calls = manifest["calls"]
    assert [c["carry"][1] for c in calls[:len(parts)]] == [f"bench/device/ship/{p['name']}" for p in parts]
    assert all("bench/device/ship/manifest.json" in c["carry"] for c in calls[:-1])
    assert "quality.sh start" in calls[-2]["command"] and "bench/device/wheels" in calls[-2]["carry"]
    assert "quality.sh wait" in calls[-1]["command"]  # sent in the same message: the machine is still held
    text = (out / "calls.md").read_text()
    assert text.count("run  command:") == len(calls) and "ONE message" in text


def test_real_part_size_leaves_room_for_the_checkout():
    """Without --part_mib a part fits the device tool's 64 MiB beside what the checkout carries."""
    travel = ship.travel_bytes()
    assert 1 << 20 < travel < 40 << 20
    assert (ship.TRAVEL_MIB - ship.MARGIN_MIB) * ship.MIB - travel > 8 << 20


def test_puts_then_join_build_the_model_and_corpora(packed, stand_in, tmp_path):
    out, manifest = packed
    dest = tmp_path / "device"
    for i in range(len(manifest["parts"])):
        proc = put(i, out, dest)
        assert proc.returncode == 0, proc.stderr
        result = json.loads(proc.stdout.splitlines()[-1])
        assert result["persisted"] and result["earlier_parts_present"] == i
    unpacked = ship.join(dest)
    model = ship.build_model(unpacked, tmp_path / "models" / "gemma3")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert AutoModelForCausalLM.from_pretrained(model).num_parameters() > 0
    assert AutoTokenizer.from_pretrained(model)("the cat").input_ids == AutoTokenizer.from_pretrained(stand_in["tokenizer"])("the cat").input_ids
    for name, files in ship.CORPORA.items():
        for f in files:
            assert (unpacked / "corpora" / name / f).read_bytes() == (stand_in["corpora"] / name / f).read_bytes()
    assert (model / "GEMMA_TERMS.html").is_file() and json.loads((model / "build.json").read_text())["gguf_sha256"] == stand_in["sha"]
    assert ship.join(dest) == unpacked  # a second join finds it unpacked


def test_a_part_gone_between_calls_is_reported_and_a_tampered_one_refused(packed, tmp_path):
    out, manifest = packed
    dest = tmp_path / "device"
    assert put(0, out, dest).returncode == 0
    (dest / "part00").unlink()  # a fresh machine: the first call's file did not persist
    proc = put(1, out, dest)
    assert proc.returncode == 3 and "did not persist" in proc.stderr and "Traceback" not in proc.stderr
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in out.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    data = bytearray((bad / "part01").read_bytes())
    data[100] ^= 0xFF
    (bad / "part01").write_bytes(bytes(data))
    proc = put(1, bad, tmp_path / "device2")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "not the packed bytes" in proc.stderr


def test_join_refuses_a_part_changed_after_put_and_names_it(packed, tmp_path):
    out, manifest = packed
    dest = tmp_path / "device"
    for i in range(len(manifest["parts"])):
        assert put(i, out, dest).returncode == 0
    data = bytearray((dest / "part01").read_bytes())
    data[7] ^= 1
    (dest / "part01").write_bytes(bytes(data))
    proc = subprocess.run([*SHIP, "join", "--dest", str(dest)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "part01" in proc.stderr and "Traceback" not in proc.stderr
    assert not any(f.name.startswith("payload") for f in dest.iterdir())  # nor the joined file (a second audit)


def copy_of(out: Path, to: Path) -> Path:
    to.mkdir()
    for f in out.iterdir():
        (to / f.name).write_bytes(f.read_bytes())
    return to


@pytest.mark.parametrize("change", ["name-a-path", "sha-missing", "bytes-a-string", "no-parts", "a-list", "payload-sha-a-number"])
def test_a_manifest_pack_did_not_write_is_one_line_and_puts_nothing_anywhere(packed, tmp_path, change):
    """The manifest travels beside the checkout and is read there as data (a second audit: a part named ``../x`` was
    copied outside the folder, a missing key ended in a KeyError traceback)."""
    out, _ = packed
    bad = copy_of(out, tmp_path / "bad")
    manifest = json.loads((bad / "manifest.json").read_text())
    if change == "name-a-path":
        (bad / "part00").rename(bad / "escaped")
        manifest["parts"][0]["name"] = "../bad/escaped"
    elif change == "sha-missing":
        del manifest["parts"][0]["sha256"]
    elif change == "bytes-a-string":
        manifest["parts"][0]["bytes"] = str(manifest["parts"][0]["bytes"])
    elif change == "no-parts":
        manifest["parts"] = []
    elif change == "payload-sha-a-number":
        manifest["payload_sha256"] = 7
    (bad / "manifest.json").write_text(json.dumps([manifest] if change == "a-list" else manifest))
    dest = tmp_path / "device" / "ship"
    proc = put(0, bad, dest)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "not a manifest" in proc.stderr, proc.stderr
    assert not (tmp_path / "device").exists()


def full_disk_at(pattern: str) -> dict:
    """``tests/fixtures/full_disk_on_rank``: a write to a path matching ``pattern`` empties it and fails with ENOSPC."""
    fixture = ROOT / "tests" / "fixtures" / "full_disk_on_rank"
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(fixture), str(ROOT)]), "RANK": "0", "ELSA_TEST_FULL_DISK_RANK": "0",
            "ELSA_TEST_FULL_DISK_AT": pattern, "ELSA_TEST_FULL_DISK_CUTS": "1"}


def test_a_full_disk_at_put_or_join_is_one_line_and_leaves_no_temp_or_joined_file(packed, tmp_path, monkeypatch):
    """The device's disk is 64 GiB, the payload a quarter GiB a time: a put that cannot copy its part says so and leaves
    no ``.partNN.tmp``; a join that cannot write the joined payload leaves neither it nor a half-unpacked folder, and
    the parts stay for a join again."""
    out, manifest = packed
    dest = tmp_path / "device"
    assert put(0, out, dest).returncode == 0
    args = ["put", "1", "--ship", str(out), "--dest", str(dest)]
    proc = subprocess.run([*SHIP, *args], cwd=ROOT, capture_output=True, text=True, timeout=120, env=full_disk_at(r"\.part01\.tmp$"))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "free space" in proc.stderr, proc.stderr
    assert sorted(f.name for f in dest.iterdir()) == ["manifest.json", "part00", "put.log"]
    for i in range(1, len(manifest["parts"])):
        assert put(i, out, dest).returncode == 0
    proc = subprocess.run([*SHIP, "join", "--dest", str(dest)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=full_disk_at(r"payload\.tar\.gz$"))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert not any(f.name.startswith("payload") for f in dest.iterdir()), sorted(f.name for f in dest.iterdir())

    def full_half_way(tar, path, **kwargs):  # tarfile writes through the open it bound at import: fail it half-way here
        tar.extract(tar.getmembers()[1], path, filter="data")
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(tarfile.TarFile, "extractall", full_half_way)
        with pytest.raises(ship.ShipError, match="free space"):
            ship.join(dest)
    assert not any(f.name.startswith("payload") for f in dest.iterdir()), sorted(f.name for f in dest.iterdir())
    assert ship.join(dest) == dest / "payload"  # the parts stayed: a join again builds it


def test_a_joined_payload_that_does_not_check_is_removed(packed, tmp_path):
    out, manifest = packed
    bad = copy_of(out, tmp_path / "bad")
    changed = json.loads((bad / "manifest.json").read_text()) | {"payload_sha256": "0" * 64}
    (bad / "manifest.json").write_text(json.dumps(changed))
    dest = tmp_path / "device"
    for i in range(len(manifest["parts"])):
        assert put(i, bad, dest).returncode == 0
    proc = subprocess.run([*SHIP, "join", "--dest", str(dest)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "does not match the manifest" in proc.stderr and "Traceback" not in proc.stderr
    assert not any(f.name.startswith("payload") for f in dest.iterdir())


def test_links_planted_in_the_destination_are_never_written_through(packed, tmp_path):
    """A third audit: put copied its part through a link at ``.partNN.tmp`` and appended its log through one at
    ``put.log``; join wrote the payload through a link at ``payload.tar.gz`` and unpacked into one at ``payload.tmp``."""
    out, manifest = packed
    dest, victims = tmp_path / "device", tmp_path / "victims"
    dest.mkdir()
    victims.mkdir()
    for name in (".part00.tmp", "put.log", "payload.tar.gz"):
        (victims / name).write_text("mine")
        (dest / name).symlink_to(victims / name)
    (victims / "folder").mkdir()
    (dest / "payload.tmp").symlink_to(victims / "folder", target_is_directory=True)
    for i in range(len(manifest["parts"])):
        assert put(i, out, dest).returncode == 0
    assert (dest / "part00").is_file() and not (dest / "part00").is_symlink()
    unpacked = ship.join(dest)
    assert all((victims / name).read_text() == "mine" for name in (".part00.tmp", "put.log", "payload.tar.gz"))
    assert not any((victims / "folder").iterdir()) and (unpacked / "payload.json").is_file()


def test_an_unpacked_payload_is_checked_again_before_it_is_used_again(packed, tmp_path):
    """A second join used an unpacked payload whose stamp named the GGUF, without checking its files (a third audit)."""
    out, manifest = packed
    dest = tmp_path / "device"
    for i in range(len(manifest["parts"])):
        assert put(i, out, dest).returncode == 0
    unpacked = ship.join(dest)
    changed = next(f for f in (unpacked / "corpora").rglob("*") if f.is_file())
    changed.write_text("not what was packed")
    assert ship.join(dest) == unpacked  # joined again from the parts
    assert changed.read_text() != "not what was packed"


def test_fifos_in_the_destination_never_block_and_a_payload_of_other_parts_is_joined_anew(packed, tmp_path):
    """The review of the audit's fix: a FIFO at ``payload.tmp`` (removing it opened it) or at ``put.log`` (appending)
    waited for good; an unpacked payload is used again only when it came from these parts (``joined.sha256``)."""
    out, manifest = packed
    dest = tmp_path / "device"
    dest.mkdir()
    os.mkfifo(dest / "put.log")
    os.mkfifo(dest / "payload.tmp")
    for i in range(len(manifest["parts"])):
        assert put(i, out, dest).returncode == 0  # the 60 s timeout: a put that waits fails here
    proc = subprocess.run([*SHIP, "join", "--dest", str(dest)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert (dest / ship.JOINED_FROM).read_text() == manifest["payload_sha256"]
    (dest / ship.JOINED_FROM).write_text("0" * 64)  # unpacked from other parts (a pack of other corpora, the same GGUF)
    (dest / "payload" / "stale").write_text("from the other payload")
    assert ship.join(dest) == dest / "payload" and not (dest / "payload" / "stale").exists()


def test_pack_names_a_cells_line_that_is_not_a_cell(stand_in, tmp_path):
    """The review: a results line cut half-way was a CellsError traceback out of `pack` (its `main` says it in one line:
    `pack`'s command line builds the real model, so the function is called here)."""
    results = tmp_path / "results.jsonl"
    results.write_text('{"key": "b", "sta\n')
    with pytest.raises(ship.CellsError, match="line 1"):
        ship.pack(stand_in["gguf"], stand_in["sha"], stand_in["tokenizer"], stand_in["corpora"], stand_in["terms"],
                  tmp_path / "out", part_mib=0.05, results=results)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("where", ["manifest", "stamp"])
def test_json_nested_past_pythons_stack_is_one_line(packed, tmp_path, where):
    """A third audit: a manifest or a payload stamp of 100,000 ``[`` ended put and join in a RecursionError traceback."""
    out, manifest = packed
    dest = tmp_path / "device"
    if where == "manifest":
        bad = copy_of(out, tmp_path / "bad")
        (bad / "manifest.json").write_text("[" * 100_000)
        proc = put(0, bad, dest)
    else:
        for i in range(len(manifest["parts"])):
            assert put(i, out, dest).returncode == 0
        (dest / "payload").mkdir()
        (dest / "payload" / "payload.json").write_text("[" * 100_000)
        proc = subprocess.run([*SHIP, "join", "--dest", str(dest)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert (proc.returncode == 2 and "cannot read the manifest" in proc.stderr) if where == "manifest" else proc.returncode == 0


@pytest.mark.parametrize("line", ['{"key": "elsa|0.9|128x8x512|rule", "sta', '{"status": "ok"}', "[" * 100_000, "[1]"])
def test_a_cells_line_that_is_not_a_cell_is_named_by_the_runner_and_the_report(tmp_path, line):
    """A runner killed half-way through a line, or a line of something else: the report and the runner name the line, one
    line, exit 2 (a third audit: KeyError and RecursionError tracebacks)."""
    results = tmp_path / "cells.jsonl"
    results.write_text('{"key": "dense|-|0x8x512|rule", "status": "ok"}\n' + line + "\n")
    with pytest.raises(ship.CellsError, match="cells.jsonl line 2"):
        ship.read_lines(results)
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "device" / "curve_report.py"), "--results", str(results),
                           "--out", str(tmp_path / "curve")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "line 2" in proc.stderr, proc.stderr[-2000:]
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "device" / "curve.py"), "--results", str(results),
                           "--out", str(tmp_path / "out"), "--list"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "line 2" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    results.write_text('{"key": "x", "status": "ok"}\n')  # a cell, but not one the report can read (a review)
    assert curve_report.main(["--results", str(results), "--out", str(tmp_path / "curve")]) == 2
    assert not (tmp_path / "curve.md").exists()


@pytest.mark.parametrize("fields,named", [({"profile": [1]}, "its profile is list, not dict"),
                                          ({"profile": {"torch": {"host_top": "ab"}}}, "its profile's host_top is not a list"),
                                          ({"profile": {"torch": {"host_ops_s": "x"}}}, "its profile's torch figures are not"),
                                          ({"step_s": "1"}, "its step_s is str, not int or float"),
                                          ({"compiled": 1}, "its compiled is int, not bool"),
                                          ({"steps": True}, "its steps is bool"), ({"batch": None}, "its batch is null"),
                                          ({"step_s": float("nan")}, "its step_s is nan"),
                                          ({"texts": {"techdocs_test": 5}}, "its texts are not names and sha256s"),
                                          ({"text_packages": {"techdocs": [1]}}, "its text_packages are not packages")])
def test_a_cells_field_of_another_type_is_named_before_the_runner_reads_it(tmp_path, fields, named):
    """The fourth audit (2026-12-05): the runner's estimator read a line's profile, step and flags as they came, so a line
    of another shape was an AttributeError, ValueError or TypeError out of curve.py. Each field the kit reads is typed by
    ``read_lines``; a line of a key and a status alone still reads, and prices nothing."""
    line = {"key": "elsa|0.9|64x8x512|rule|plain", "status": "ok", "device": "NVIDIA H200", "kind": "train",
            "method": "elsa", "steps": 64, "step_s": 1.0, "wall_s": 100.0,
            "profile": {"torch": {"host_ops_s": 0.5, "host_top": [["Command Buffer Full", 0.1]]}}}
    results = tmp_path / "cells.jsonl"
    results.write_text(json.dumps(line) + "\n" + json.dumps({"key": "x", "status": "ok"}) + "\n")
    assert len(ship.read_lines(results)) == 2
    simulate = [sys.executable, str(ROOT / "bench" / "device" / "curve.py"), "--simulate", "NVIDIA H200", "--results",
                str(results), "--out", str(tmp_path / "out")]
    proc = subprocess.run(simulate, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results.write_text(json.dumps({**line, **fields}) + "\n")
    with pytest.raises(ship.CellsError, match=f"cells.jsonl line 1: {re.escape(named)}"):
        ship.read_lines(results)
    proc = subprocess.run(simulate, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and named in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_pack_refuses_a_gguf_that_is_not_the_packages(stand_in, tmp_path):
    with pytest.raises(ship.ShipError, match="sha256"):
        ship.pack(stand_in["gguf"], "0" * 64, stand_in["tokenizer"], stand_in["corpora"], None, tmp_path / "s", part_mib=1)
    (stand_in["corpora"] / "techdocs" / "test.jsonl").rename(tmp_path / "moved")
    try:
        with pytest.raises(ship.ShipError, match="corpora.py --name techdocs"):
            ship.pack(stand_in["gguf"], stand_in["sha"], stand_in["tokenizer"], stand_in["corpora"], None, tmp_path / "s")
    finally:
        (tmp_path / "moved").rename(stand_in["corpora"] / "techdocs" / "test.jsonl")


def test_cells_on_other_texts_are_refused_before_packing_and_before_running(stand_in, tmp_path):
    """A corpus rebuilt from other package versions is another text: pack (here) and the runner (there) refuse to add
    its cells to results that ran on other texts, naming the text; the first loans' lines (no digests) count as run
    on UNRECORDED_TEXTS."""
    texts = ship.texts_sha256(stand_in["corpora"])
    assert set(texts) == {"train", "test", "linuxdoc"} and texts != ship.UNRECORDED_TEXTS
    same, other, unrecorded = (tmp_path / f"{n}.jsonl" for n in ("same", "other", "unrecorded"))
    line = {"key": "wanda+ft|0.9|128x8x512|rule", "status": "ok"}
    same.write_text(json.dumps(line | {"texts": texts}) + "\n" + json.dumps({"key": "x", "status": "failed"}) + "\n")
    other.write_text(json.dumps(line | {"texts": texts | {"test": "0" * 64}}) + "\n")
    unrecorded.write_text(json.dumps(line) + "\n")
    assert ship.texts_mismatch(ship.read_lines(same), texts, same) is None
    why = ship.texts_mismatch(ship.read_lines(other), texts, other)
    assert "test " + texts["test"][:12] + " here, 000000000000 there" in why and "train" not in why and line["key"] in why
    assert "train" in ship.texts_mismatch(ship.read_lines(unrecorded), texts, unrecorded)
    # where the packages the texts came from differ, the commands that rebuild the lines' texts (2026-12-01: an AMD box's
    # linux-doc 6.1.176-1 gave another test split than the 6.1.192-2 the cells ran on)
    packages = ship.texts_packages(stand_in["corpora"])
    assert set(packages) == set(ship.CORPORA) and ship.texts_packages(tmp_path) == {c: {} for c in ship.CORPORA}
    pinned = tmp_path / "pinned.jsonl"
    pinned.write_text(json.dumps(line | {"texts": texts | {"linuxdoc": "0" * 64},
                                         "text_packages": {"linux-doc": {"linux-doc": "9.9-1", "linux-doc-9.9": "9.9-1"}}}) + "\n")
    why = ship.texts_mismatch(ship.read_lines(pinned), texts, pinned, {"linux-doc": {"linux-doc": "9.8-1", "linux-doc-9.9": "9.9-1"}})
    assert ("(here: linux-doc 9.8-1): apt-get install -y --allow-downgrades linux-doc=9.9-1 && python bench/models/corpora.py "
            "--name linux-doc --force (a version apt") in why
    why = ship.texts_mismatch(ship.read_lines(unrecorded), texts, unrecorded, packages)
    assert "linux-doc=6.1.192-2 linux-doc-6.1=6.1.192-2" in why and "--name techdocs" in why  # the first loans' texts
    with pytest.raises(ship.ShipError, match="texts differ"):
        ship.pack(stand_in["gguf"], stand_in["sha"], stand_in["tokenizer"], stand_in["corpora"], stand_in["terms"],
                  tmp_path / "ship", part_mib=0.05, results=other)
    assert not (tmp_path / "ship").exists()  # refused before anything was written
    proc = subprocess.run([sys.executable, "bench/device/curve.py", "--model", str(stand_in["tokenizer"]), "--corpora",
                           str(stand_in["corpora"]), "--results", str(unrecorded), "--out", str(tmp_path / "OUT")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "texts differ" in proc.stderr and not (tmp_path / "OUT").exists()


def test_the_plan_runs_the_smaller_budgets_first_and_skips_cells_done_before(tmp_path):
    plan = curve.curve_plan()
    smaller = [c for c in plan[:7] if c.settings == "rule"]
    largest = plan[7:10]  # sequences of 512: three budgets spanning 16x, the largest the 2048 x 8 x 512 tokens
    assert [c.steps * c.batch for c in smaller + largest] == [128 * 8] * 3 + [512 * 8] * 3 + [2048 * 8] * 3
    assert {c.sparsity for c in plan[:10]} == {0.9} and {c.method for c in largest} == {"elsa", "sparsegpt+ft", "wanda+ft"}
    # the rule's held end at the middle budget (the rule holds none from ~450 steps), then what the issue must show: the
    # largest budget at 90 % and at 70 %; then the held end there and the rule with half its λ, the middle budget's dense
    # start and the authors' residual balancing from it, the largest's tokens in 2048 steps of 8 (where a loan has their time), the paper's
    # settings at the largest, then its dense start
    assert plan[6] == curve.Cell("elsa", 0.9, 512, "held")
    assert plan[10:13] == [replace(c, sparsity=0.7) for c in largest]
    assert plan[13:15] == [curve.Cell("elsa", 0.9, 512, s, 32) for s in ("held", "half_lmda")]
    # the compiled loop beside the first budget's ELSA cell (the same quality? its pace and compile time, measured)
    assert plan[15] == replace(plan[0], compiled=True) and plan[15].key(512) == plan[0].key(512) + "|compiled"
    assert plan[16:18] == [curve.Cell("elsa", 0.9, 512, s) for s in ("dense", "adaptive")]
    many = plan[18:21]  # compiled: 2048 steps of 8 x 512 are the host's time a step, which the fused graphs cut
    assert [(c.steps, c.batch, c.settings) for c in many] == [(2048, 8, "rule")] * 3 and many == [
        curve.Cell(c.method, 0.9, 2048, compiled=True) for c in largest]
    assert plan[21:23] == [curve.Cell("elsa", 0.9, 512, s, 32) for s in ("paper", "dense")]  # the item 3 first
    assert plan[23:26] == [replace(c, settings="seed1") for c in largest]  # then the verdict's spread: another seed
    assert curve.Cell("dense+ft", None, 512, batch=32) in plan
    assert len(set(plan)) == len(plan)
    beyond = plan[-3:]  # last: 4x the largest's tokens in 2048 steps of 32, ELSA's cell first (its retraining waits on it)
    assert beyond == [curve.Cell(c.method, 0.9, 2048, batch=32, compiled=True) for c in largest] and curve.BEYOND in curve.LONG
    assert {c.compiled for c in plan if c.steps == 2048} == {True} and not any(c.compiled for c in plan[:15])
    done = tmp_path / "done.jsonl"
    done.write_text(json.dumps({"key": plan[0].key(512), "status": "ok"}) + "\n" + json.dumps({"key": plan[1].key(512), "status": "cut"}) + "\n")
    assert curve.done_keys(done) == {plan[0].key(512)}
    with pytest.raises(ValueError, match="method:sparsity:steps"):
        curve.parse_cell("elsa:0.9")
    with pytest.raises(ValueError, match="paper"):
        curve.parse_cell("wanda+ft:0.9:100:paper")


@pytest.fixture
def cell_plan(tmp_path, monkeypatch):
    """A cell's command as launch/prune.py reads it, made into the job's plan (weight-free), on the demo model."""
    from elsa_ds.cli import prune_parser, settings_from_args
    from elsa_ds.plan import make_plan

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    text = tmp_path / "train.jsonl"
    text.write_text("".join(json.dumps({"text": f"line {i} of the training text"}) + "\n" for i in range(64)))
    run = curve.Run(str(DEMO_MODEL_DIR), str(text), str(text), str(text), 64, 8, "zero3_offload", 4, tmp_path, 0.0, 1, {})

    def plan(cell: curve.Cell):
        cmd = curve.prune_command(cell, run, tmp_path / cell.slug())
        argv = cmd[cmd.index(str(ROOT / "launch" / "prune.py")) + 1:]
        opts, cfg, ds_config = settings_from_args(prune_parser().parse_args(argv))
        return make_plan(cfg, opts, ds_config)
    return plan


def test_the_paper_cell_runs_the_authors_recipe_and_a_rule_cell_leaves_the_rest_to_the_rule(cell_plan):
    """Each cell's command made into the job's plan: the paper's cell takes the authors' README recipe and their code's
    defaults, not the rule's; the rule's cell sets none of them."""
    plan = cell_plan
    paper = plan(curve.Cell("elsa", 0.9, 40, "paper"))
    c = paper.cfg
    assert (c.lr, c.lmda, c.lmda_schedule.value, c.interval, c.warmup_steps, c.lr_final_ratio) == (2e-4, 0.01, "constant", 32, 0, 0.0)
    assert tuple(c.betas) == (0.9, 0.95) and c.init_mask is None and c.hold_steps == 0 and c.projection.value == "fisher"
    assert not {"lr", "lmda", "lmda_schedule", "interval", "warmup_steps", "init_mask", "hold_steps"} & set(paper.defaults["applied"])
    assert (c.steps, c.sparsity) == (40, 0.9)
    rule = plan(curve.Cell("elsa", 0.9, 40))
    assert {"lr", "lmda", "init_mask"} <= set(rule.defaults["applied"]) and tuple(rule.cfg.betas) == (0.9, 0.999)
    assert rule.cfg.init_mask is not None and rule.cfg.init_weights  # a short budget: the rule starts from SparseGPT's model
    dense = plan(curve.Cell("elsa", 0.9, 40, "dense"))
    assert dense.cfg.init_mask is None and "init_mask" not in dense.defaults["applied"] and "lr" in dense.defaults["applied"]
    adaptive = plan(curve.Cell("elsa", 0.9, 40, "adaptive"))  # the remedy: the dense cell's settings but the λ schedule
    assert adaptive.cfg.lmda_schedule.value == "adaptive" and adaptive.cfg.init_mask is None
    assert adaptive.cfg.model_dump(exclude={"lmda_schedule"}) == dense.cfg.model_dump(exclude={"lmda_schedule"})
    long_rule, held = plan(curve.Cell("elsa", 0.9, 512)), plan(curve.Cell("elsa", 0.9, 512, "held"))
    assert long_rule.cfg.hold_steps == 0 and held.cfg.hold_steps == 256  # from ~450 steps the rule holds no end: the cell does
    assert held.cfg.model_dump(exclude={"hold_steps"}) == long_rule.cfg.model_dump(exclude={"hold_steps"})
    for steps in (512, 2048):  # half the rule's λ, every other setting the rule's (its start and warm-up kept as flags)
        rule, half = plan(curve.Cell("elsa", 0.9, steps)), plan(curve.Cell("elsa", 0.9, steps, "half_lmda"))
        assert half.cfg.lmda == pytest.approx(rule.cfg.lmda / 2) and "lmda" in rule.defaults["applied"]
        assert half.cfg.model_dump(exclude={"lmda"}) == rule.cfg.model_dump(exclude={"lmda"})
        assert not set(half.defaults["applied"]) & {"lr", "lmda", "init_mask", "warmup_steps"}
    with pytest.raises(ValueError, match="for elsa only"):
        curve.parse_cell("wanda+ft:0.9:512:half_lmda")
    for method in ("elsa", "wanda+ft"):  # another seed: the batches' order and the calibration samples, nothing else
        rule, seed = plan(curve.Cell(method, 0.9, 512)), plan(curve.Cell(method, 0.9, 512, "seed1"))
        assert (rule.cfg.seed, seed.cfg.seed) == (0, 1)
        assert seed.cfg.model_dump(exclude={"seed"}) == rule.cfg.model_dump(exclude={"seed"})
    with pytest.raises(ValueError, match="'seed1' for elsa or sparsegpt"):
        curve.parse_cell("dense+ft:-:512:seed1")
    for text in ("elsa:-:512:half_lmda", "wanda+ft:-:512:elsa_lr"):  # the rule's settings at no sparsity: refused
        with pytest.raises(ValueError, match="at the cell's sparsity; give one"):
            curve.parse_cell(text)


def test_an_lr_control_takes_the_other_methods_rule_lr_and_every_other_setting_from_its_own_rule(cell_plan):
    """The fairness controls: a retraining cell at the lr the rule gives ELSA (and ELSA at retraining's) differs from its
    rule cell in the lr alone; the rule's start, warm-up, λ and held end stay (a user's lr alone would drop them)."""
    parted = []
    for sparsity, steps in ((0.7, 512), (0.9, 2048), (0.9, 40)):
        elsa, ft = cell_plan(curve.Cell("elsa", sparsity, steps)), cell_plan(curve.Cell("sparsegpt+ft", sparsity, steps))
        elsa_at = cell_plan(curve.Cell("elsa", sparsity, steps, "retrain_lr"))
        ft_at = cell_plan(curve.Cell("sparsegpt+ft", sparsity, steps, "elsa_lr"))
        assert (elsa_at.cfg.lr, ft_at.cfg.lr) == (ft.cfg.lr, elsa.cfg.lr)
        assert elsa_at.cfg.model_dump(exclude={"lr"}) == elsa.cfg.model_dump(exclude={"lr"})
        assert ft_at.cfg.model_dump(exclude={"lr"}) == ft.cfg.model_dump(exclude={"lr"})
        assert not set(elsa_at.defaults["applied"]) & {"lr", "init_mask", "warmup_steps", "lmda"}
        parted.append(abs(elsa.cfg.lr / ft.cfg.lr - 1) > 0.1)
    assert parted == [True, True, False]  # the plan's controls sit where the rule's lrs part; at 40 steps they meet
    plan = curve.curve_plan()
    controls = [c for c in plan if c.settings in curve.SWAPPED_LR]
    assert controls == plan[-6:-3] and {c.sparsity for c in controls} == {0.7, 0.9}  # then the budget past the issue's
    assert curve.parse_cell("wanda+ft:0.9:100:elsa_lr").settings == "elsa_lr"
    assert [curve.parse_cell(c).settings for c in ("dense:-:0", "sparsegpt:0.9:0", "dense+ft:-:100")] == ["rule"] * 3
    for wrong in ("elsa:0.9:100:elsa_lr", "sparsegpt+ft:0.9:100:retrain_lr", "dense+ft:-:100:elsa_lr", "wanda+ft:0.9:100:held"):
        with pytest.raises(ValueError, match="for elsa only"):
            curve.parse_cell(wrong)


def test_the_estimate_learns_from_finished_cells_of_the_same_device():
    """Seconds per forward, and measured / estimated GPU bytes, from finished cells of the same GPU; runs without gradient
    checkpointing measured apart from those with it once there are any (before 2026-11-29 all had it)."""
    lines = [{"device": "H", "status": "ok", "kind": "train", "steps": 100, "batch": 8, "seqlen": 512, "step_s": 0.3,
              "wall_s": 80.0, "peak_gpu_bytes": 3e9, "est_gpu_bytes": 2e9},
             {"device": "other", "status": "ok", "kind": "train", "steps": 100, "step_s": 9.0, "wall_s": 990.0,
              "peak_gpu_bytes": 9e9, "est_gpu_bytes": 1e9}]
    est = estimate.Estimator("H", lines, micro_batch=16, model=None, seqlen=512)
    assert est.seconds(curve.Cell("elsa", 0.9, 1000), 3) == pytest.approx(50.0 + 1000 * 0.3)
    assert est.seconds(curve.Cell("elsa", 0.9, 1000, batch=32), 3) == pytest.approx(50.0 + 2000 * 0.3)  # two forwards a step
    assert est.seconds(curve.Cell("sparsegpt", 0.9, 0), 3) == estimate.PRIOR_OVERHEAD_S["oneshot"]
    sized = estimate.Estimator("H", lines, micro_batch=16, model=str(DEMO_MODEL_DIR), deepspeed=str(ROOT / "ds_configs/zero3.json"), seqlen=64)
    big, small = curve.Cell("elsa", 0.9, 10, batch=32), curve.Cell("wanda+ft", 0.9, 10, batch=8)
    assert sized.gpu_bytes(big) == pytest.approx(1.5 * sized.estimate(big)) and sized.estimate(big) > sized.estimate(small) > 0
    assert est.gpu_bytes(curve.Cell("dense", None, 0)) == estimate.OTHER_GPU_BYTES
    est.add({"device": "H", "status": "ok", "kind": "train", "steps": 100, "batch": 32, "seqlen": 256, "step_s": 0.4,
             "forwards": 2, "gradient_checkpointing": False, "wall_s": 60.0})
    assert est.seconds(curve.Cell("elsa", 0.9, 1000), 3) == pytest.approx(50.0 + 1000 * 0.2 * estimate.OTHER_METHOD)  # its regime's
    est.add({"device": "H", "status": "failed", "phase": "evaluate", "kind": "train", "steps": 100, "wall_s": 900.0})
    assert est.seconds(curve.Cell("elsa", 0.9, 1000), 3) == pytest.approx(50.0 + 1000 * 0.2 * estimate.OTHER_METHOD)  # not a cell's
    assert estimate.Estimator("H", [], model=str(DEMO_MODEL_DIR), seqlen=64).gpu_bytes(small) == pytest.approx(
        estimate.PRIOR_GPU_RATIO * sized.estimate(small))  # no cell measured yet: the prior ratio
    nowhere = estimate.Estimator("H", [], model=str(ROOT / "no-such-model"), seqlen=64)
    assert nowhere.estimate(small) is None and nowhere.gpu_bytes(small) == 0.0  # no estimate: never a lost cell


def test_the_estimate_prices_the_next_cells_from_those_that_stepped_as_they_will():
    """A cell's forward is priced by the finished cells of its regime (checkpointing, --leaf_layers, torch's F.linear) and
    method (another method's x OTHER_METHOD), by the others' slowest until one ends; a larger forward adds its extra FLOPs
    at the GPU's typical rate once for every cell sharing it. The overhead (launch, load, one-shot start, export,
    evaluation) does not depend on the regime: the largest of the same method and settings, else of any cell of its kind,
    so that a cell that ran alone, or a faster method's, never prices one that will not (a review, 2026-12-01)."""
    def line(method, step_s, wall_s, **how):
        return {"device": "H", "status": "ok", "kind": "train", "method": method, "settings": "rule", "steps": 100,
                "batch": 8, "seqlen": 512, "forwards": 1, "step_s": step_s, "wall_s": wall_s, **how}

    new = {"gradient_checkpointing": False, "leaf_layers": True, "memory_efficient_linear": False}
    old = [line("elsa", 0.6, 60.0 + 200.0), line("wanda+ft", 0.5, 50.0 + 120.0, gradient_checkpointing=False)]
    model = str(DEMO_MODEL_DIR)
    est = estimate.Estimator("H", old, micro_batch=32, model=model, seqlen=512, leaf_layers=True, torch_linear=True)
    elsa, wanda, dense = curve.Cell("elsa", 0.9, 1000), curve.Cell("wanda+ft", 0.9, 1000), curve.Cell("dense+ft", None, 1000)
    held = curve.Cell("elsa", 0.9, 1000, "held")
    assert est.seconds(elsa, 4) == pytest.approx(200.0 + 1000 * 0.6)  # no cell of the new regime yet: the old ones' slowest
    assert est.seconds(wanda, 4) == pytest.approx(120.0 + 1000 * 0.6)  # its own method's overhead
    assert est.seconds(dense, 4) == pytest.approx(200.0 + 1000 * 0.6)  # no dense+ft cell: the kind's largest
    est.add(line("wanda+ft", 0.2, 90.0 + 20.0, **new))
    assert est.seconds(wanda, 4) == pytest.approx(120.0 + 1000 * 0.2)  # its regime's forward; the largest overhead kept
    assert est.seconds(elsa, 4) == pytest.approx(200.0 + 1000 * 0.2 * estimate.OTHER_METHOD)  # another method's forward
    assert est.seconds(held, 4) == pytest.approx(200.0 + 1000 * 0.2 * estimate.OTHER_METHOD)  # the kind's largest overhead
    est.add(line("elsa", 0.25, 25.0 + 10.0, **new))  # a cell that ran alone at a loan's end: fast start, fast steps
    assert est.seconds(elsa, 4) == pytest.approx(200.0 + 1000 * 0.25)
    per_token = estimate.gpu_seconds_per_token(model, 512, False)
    assert per_token and 1e-9 < per_token < 1e-6  # the demo: 4.2 M parameters at 400 TFLOP/s
    wide = curve.Cell("elsa", 0.9, 1000, batch=32)  # one forward of 32 x 512 where 8 x 512 was measured: 4 cells share it
    assert est.seconds(wide, 4) == pytest.approx(200.0 + 1000 * (0.25 + 24 * 512 * per_token * 4))
    est.add(line("elsa", 0.45, 200.0 + 45.0, batch=32) | new)  # a 32 x 512 forward prices neither 8 x 512's nor a smaller one
    assert est.seconds(elsa, 4) == pytest.approx(200.0 + 1000 * 0.25)  # the cell's own tokens a forward
    assert est.seconds(wide, 4) == pytest.approx(200.0 + 1000 * 0.45)
    assert est.seconds(curve.Cell("elsa", 0.9, 1000, batch=64), 4) == pytest.approx(  # two forwards of 32 x 512: measured
        200.0 + 2000 * 0.45)
    est.leaf_layers = est.torch_linear = False  # a fallback: the cells from now on step as the old ones
    assert est.seconds(wanda, 4) == pytest.approx(120.0 + 1000 * 0.5)  # the old regime's (wanda+ft's without checkpointing)
    assert estimate.regime({}) == (True, False, False, "deepspeed", "transformers")
    assert estimate.regime(new) == (False, True, True, "deepspeed", "transformers")
    plain = estimate.Estimator("H", [], micro_batch=32, model=model, seqlen=512, engine="plain")
    for one in est.forward_s:  # the engine's cells measured so far, and one plain cell
        plain.forward_s.append(one)
    plain.add(line("sparsegpt+ft", 0.05, 40.0 + 5.0, gradient_checkpointing=False, engine="plain"))
    plain.add(line("elsa", 0.6, 200.0 + 60.0, gradient_checkpointing=False))  # the engine's overhead: not a plain cell's
    plain_elsa = replace(elsa, engine="plain")
    assert plain.seconds(plain_elsa, 4) == pytest.approx(200.0 + 1000 * 0.05 * estimate.OTHER_METHOD)  # its loop's forward
    plain.add(line("elsa", 0.06, 30.0 + 6.0, gradient_checkpointing=False, engine="plain"))
    assert plain.seconds(plain_elsa, 4) == pytest.approx(30.0 + 1000 * 0.06)  # and its loop's overhead, once measured
    assert plain_elsa.key(512) == "elsa|0.9|1000x8x512|rule|plain" and elsa.key(512) == "elsa|0.9|1000x8x512|rule"


def test_a_cell_is_priced_with_the_start_it_will_have():
    """The rule starts ELSA from SparseGPT's model below 2048 steps and from the dense weights from there (as the dense and
    adaptive settings always do): a one-shot start's seconds are in the overhead of the first, not of the second (a
    review: the 2048-step cells were priced with SparseGPT's start in and never fitted a loan)."""
    def line(settings, wall_s, init_mask, steps=512):
        return {"device": "H", "status": "ok", "kind": "train", "method": "elsa", "settings": settings, "sparsity": 0.9,
                "steps": steps, "batch": 8, "seqlen": 512, "step_s": 0.2, "wall_s": wall_s + steps * 0.2,
                "settings_used": {"init_mask": init_mask}}

    rule, many = curve.Cell("elsa", 0.9, 512), curve.Cell("elsa", 0.9, 2048)
    assert estimate.starts_pruned("elsa", "rule", 0.9, 512) and not estimate.starts_pruned("elsa", "rule", 0.9, 2048)
    assert estimate.starts_pruned("elsa", "half_lmda", 0.9, 512) and not estimate.starts_pruned("elsa", "half_lmda", 0.9, 2048)
    assert not estimate.starts_pruned("elsa", "rule", 0.95, 512) and not estimate.starts_pruned("elsa", "dense", 0.9, 512)
    assert estimate.starts_pruned("wanda+ft", "rule", 0.9, 2048) is None
    est = estimate.Estimator("H", [line("rule", 230.0, "sparsegpt")], model=None, seqlen=512)
    assert est.seconds(many, 4) == pytest.approx(230.0 + 2048 * 0.2)  # nothing from the dense start yet: the kind's largest
    est.add(line("dense", 150.0, "none"))
    assert est.seconds(many, 4) == pytest.approx(150.0 + 2048 * 0.2)  # the dense start's, under another setting
    assert est.seconds(rule, 4) == pytest.approx(230.0 + 512 * 0.2)
    est.add(line("rule", 160.0, None, steps=2048))  # its own, once measured
    assert est.seconds(many, 4) == pytest.approx(160.0 + 2048 * 0.2)


def test_cells_start_only_while_their_gpu_peaks_fit_beside_the_running_ones(tmp_path, monkeypatch):
    """Two cells that would not fit together run one after the other; one that fits with neither never starts."""
    started: list[tuple[str, int]] = []
    running: set[str] = set()

    def fake_cell(cell, run):
        running.add(cell.key(run.seqlen))
        started.append((cell.key(run.seqlen), len(running)))
        time.sleep(0.3)
        running.discard(cell.key(run.seqlen))
        return {"key": cell.key(run.seqlen), "status": "ok", "kind": cell.kind, "steps": cell.steps, "wall_s": 0.3}

    class Sized(estimate.Estimator):
        def estimate(self, cell):
            return cell.batch * 1e9

    monkeypatch.setattr(curve, "run_cell", fake_cell)
    est = Sized("H", [], micro_batch=64)
    one = est.gpu_bytes(curve.Cell("elsa", 0.9, 1, batch=16)) / curve.GPU_SHARE
    run = curve.Run("m", "t", "t", "t", 64, 64, "z", 4, tmp_path, time.time() + 600, 3, {}, gpu_memory=1.5 * one)
    cells = [curve.Cell("elsa", 0.9, 1, batch=16), curve.Cell("wanda+ft", 0.9, 1, batch=16), curve.Cell("elsa", 0.9, 1, batch=64)]
    lines, skipped = curve.schedule(cells, run, est, tmp_path / "cells.jsonl")
    assert [k for k, _ in started] == [cells[0].key(64), cells[1].key(64)] and all(n == 1 for _, n in started)
    assert [s["key"] for s in skipped] == [cells[2].key(64)] and len(lines) == 2


def test_the_report_gives_elsa_over_the_best_retraining_per_budget_and_plots(tmp_path):
    def cell(method, sparsity, steps, test, kind="train", settings="rule", status="ok", batch=8, engine="deepspeed",
             compiled=False):
        key = f"{method}|{sparsity}|{steps}x{batch}|{settings}" + curve.ENGINE_KEYS[engine] + "|compiled" * compiled
        return {"key": key, "method": method, "sparsity": sparsity, "steps": steps, "settings": settings, "kind": kind,
                "batch": batch, "tokens": steps * batch * 512, "test_ppl": test, "linuxdoc_ppl": 2 * test, "status": status,
                "device": "GPU", "engine": engine, "compiled": compiled}

    lines = [cell("elsa", 0.9, 125, 40.0), cell("sparsegpt+ft", 0.9, 125, 32.0), cell("wanda+ft", 0.9, 125, 36.0),
             cell("elsa", 0.9, 2000, 30.0, status="cut"), cell("elsa", 0.9, 2000, 20.0), cell("wanda+ft", 0.9, 2000, 25.0),
             cell("elsa", 0.9, 2000, 22.0, settings="paper"), cell("elsa", 0.9, 2000, 10.0, settings="held"),
             cell("elsa", 0.9, 2000, 12.0, settings="adaptive"), cell("dense", None, 0, 20.0, kind="eval"),
             cell("sparsegpt", 0.9, 0, 700.0, kind="oneshot"),
             cell("elsa", 0.9, 500, 24.0, batch=32), cell("wanda+ft", 0.9, 500, 25.0, batch=32),  # 2000 x 8's tokens
             # the plain loop's cells: a row and a ratio of their own, never mixed with the engine's
             cell("elsa", 0.9, 2000, 18.0, engine="plain"), cell("sparsegpt+ft", 0.9, 2000, 24.0, engine="plain"),
             # and its compiled cells: their own again (the same budget as an eager cell never overwrites it)
             cell("elsa", 0.9, 2000, 19.0, engine="plain", compiled=True),
             cell("wanda+ft", 0.9, 2000, 38.0, engine="plain", compiled=True),
             # the same cells on another seed: the verdict's ratio again, beside the rule's, never in its place
             cell("elsa", 0.9, 2000, 21.0, settings="seed1", engine="plain"),
             cell("sparsegpt+ft", 0.9, 2000, 20.0, settings="seed1", engine="plain")]
    results = tmp_path / "cells.jsonl"
    results.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert curve_report.main(["--results", str(results), "--out", str(tmp_path / "curve")]) == 0
    md = (tmp_path / "curve.md").read_text()
    # 40/32 at 125 steps; 24/25 at 500 x 32; 20/25 at 2000 x 8 (not the cut 30): the same tokens, budgets of their own
    assert "| method | 512,000 tokens (125 steps) | 8,192,000 tokens (500 steps) | 8,192,000 tokens (2000 steps) |" in md
    assert "| **ELSA / best retraining**, techdocs test | 1.25 | 0.96 | 0.80 |" in md
    assert "| **ELSA / best retraining (plain loop)**, techdocs test |  |  | 0.75 |" in md
    assert "| **ELSA / best retraining (seed 1) (plain loop)**, techdocs test |  |  | 1.05 |" in md
    assert "| elsa (seed 1) (plain loop), techdocs test |  |  | 21.00 |" in md
    assert "| elsa (plain loop), techdocs test |  |  | 18.00 |" in md
    assert "| elsa (compiled), techdocs test |  |  | 19.00 |" in md
    assert "| **ELSA / best retraining (compiled)**, techdocs test |  |  | 0.50 |" in md
    assert "elsa (paper's settings), techdocs test |  |  | 22.00 |" in md and "sparsegpt 700.00 / 1400.00" in md
    # the variants are rows of their own: none of them takes the rule's place in the ratio
    assert "elsa (held end), techdocs test |  |  | 10.00 |" in md and "elsa (residual balancing), techdocs test |  |  | 12.00 |" in md
    assert (tmp_path / "curve.png").stat().st_size > 10_000
    assert curve_report.main(["--results", str(tmp_path / "none.jsonl")]) == 2
    without_dense = tmp_path / "no_dense.jsonl"  # before a loan's dense cell: drawn all the same
    without_dense.write_text("".join(json.dumps(x) + "\n" for x in lines if x["method"] != "dense"))
    assert curve_report.main(["--results", str(without_dense), "--out", str(tmp_path / "no_dense")]) == 0
    # every training label a cell can have is drawn in a colour of its own (else matplotlib's cycle repeats ELSA's)
    methods = {"rule": ("elsa", "sparsegpt+ft", "wanda+ft", "dense+ft")}
    labels = {m + curve_report.LABELS.get(s, "") for s in curve.SETTINGS for m in methods.get(s, curve.ALLOWED.get(s, ("elsa",)))}
    assert labels <= set(curve_report.COLORS) and len(set(curve_report.COLORS.values())) == len(curve_report.COLORS)


def test_the_report_draws_the_same_curve_from_the_quality_bench_on_another_model(tmp_path):
    """bench/quality.py's payloads, one per budget: a cell per row, dense and the starts once, one held-out text."""
    def payload(steps, elsa, wanda_ft, extra=()):
        rows = [{"row": "dense", "sparsity": None, "ppl": 70.0, "tokens": 0},
                {"row": "sparsegpt", "sparsity": 0.9, "ppl": 300.0, "tokens": 32768},
                {"row": "wanda+ft", "sparsity": 0.9, "ppl": wanda_ft, "tokens": steps * 2048},
                {"row": "elsa", "sparsity": 0.9, "ppl": elsa, "tokens": steps * 2048}, *extra]
        path = tmp_path / f"s{steps}.json"
        path.write_text(json.dumps({"model": "demo", "seqlen": 256, "steps": steps, "results": rows}))
        return path

    paths = [payload(125, 100.0, 80.0), payload(2000, 60.0, 75.0, [{"row": "dense+ft", "sparsity": None, "ppl": 50.0,
                                                                      "tokens": 2000 * 2048}])]
    assert curve_report.main(["--quality", *map(str, paths), "--name", "the demo", "--test_label", "held-out plays"]) == 0
    md = (tmp_path / "s2000.md").read_text()
    assert md.startswith("# The budget curve on the demo (cpu)") and "linux-doc" not in md
    assert "| **ELSA / best retraining**, held-out plays | 1.25 | 0.80 |" in md
    assert "| dense+ft, held-out plays |  | 50.00 |" in md and "Untrained: dense 70.00, sparsegpt 300.00 (held-out plays)." in md
    assert (tmp_path / "s2000.png").stat().st_size > 10_000
    cells = curve_report.from_quality(paths)
    assert curve_report.plot(cells, [0.9], tmp_path / "p.png", (("test_ppl", "plays"),), "the demo") == ["the demo, 90%"]


def quality_sh_dry_run(packed, tmp_path: Path, cells: str) -> Path:
    """The parts put into a scratch device folder, then ``quality.sh --dry-run start`` with ``cells`` (curve.py's flags)
    on tiny shapes; returns the device folder. The lines land in tmp_path/OUT."""
    out, manifest = packed
    dest = tmp_path / "device"
    for i in range(len(manifest["parts"])):
        assert put(i, out, dest).returncode == 0
    env = {**os.environ, "ELSA_SHIP": str(dest), "ELSA_MODELS": str(tmp_path / "models"), "ELSA_CURVE": str(tmp_path / "runs"),
           "OUT": str(tmp_path / "OUT"), "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": "",
           "CURVE_ARGS": f"{cells} --seqlen 32 --micro_batch 2 --eval_limit 4 --parallel 2 --profile 0:1 "
                         f"--results {tmp_path / 'none.jsonl'}"}
    proc = subprocess.run(["bash", "bench/device/quality.sh", "--dry-run", "start", "500", "480"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return dest


@pytest.mark.integration
def test_quality_sh_dry_run_ships_builds_and_runs_cells(packed, tmp_path):
    """quality.sh start on CPU: join + build from the put parts, the runner detached, two cells, their lines back in OUT."""
    dest = quality_sh_dry_run(packed, tmp_path, "--engine deepspeed --cells dense:-:0,elsa:0.9:2:rule:2")
    lines = [json.loads(x) for x in (tmp_path / "OUT" / "cells.jsonl").read_text().splitlines()]
    assert {x["key"] for x in lines} == {"dense|-|0x8x32|rule", "elsa|0.9|2x2x32|rule"}
    for line in lines:
        assert line["status"] == "ok" and math.isfinite(line["test_ppl"]) and math.isfinite(line["linuxdoc_ppl"])
        assert line["device"] == "cpu" and line["code_sha"] and line["eval"]["windows"]["test"] == 4
        assert line["texts"] == ship.texts_sha256(dest / "payload" / "corpora")  # the shipped texts, by sha256
    elsa = next(x for x in lines if x["method"] == "elsa")
    assert elsa["tokens"] == 2 * 2 * 32 and abs(elsa["overall_sparsity"] - 0.9) < 1e-3 and elsa["settings_used"]["lr"] > 0
    assert (elsa["forwards"], elsa["gradient_checkpointing"], elsa["loss"]) == (1, False, "chunked") and elsa["est_gpu_bytes"] > 0
    assert elsa["leaf_layers"] is True  # the cells hook each decoder layer whole (the job's flag: its log, below)
    assert elsa["memory_efficient_linear"] is False  # torch's F.linear: the config the cell ran with (its log, below)
    assert elsa["prune_s"] > elsa["job_s"] > 0
    phases = elsa["phase_s"]  # where its time went, from the job's phase markers
    assert {"launch", "load", "first step", "final projection", "export", "verify", "after"} <= set(phases)
    assert 0 < sum(phases.values()) <= elsa["prune_s"] + 1 and next(x for x in lines if x["method"] == "dense")["phase_s"] is None
    profile = elsa["profile"]  # step 0 under torch.profiler, step 1 under cProfile: where a step's time went
    assert profile["torch"]["complete"] and set(profile["torch"]["spans_s"]) == set(SPANS) and profile["torch"]["wall_s"] > 0
    assert profile["torch"]["host_top"] and profile["python"]["self_top"] and profile["python"]["complete"]
    assert "profile" not in next(x for x in lines if x["method"] == "dense")  # an evaluation has no steps to profile
    assert elsa["ran_beside"] == ["dense|-|0x8x32|rule"]  # --parallel 2: the two cells started together
    with tarfile.open(tmp_path / "OUT" / "cell_logs.tgz") as logs:  # each cell's own log, in one file of the 8 that come back
        assert sorted(logs.getnames()) == ["./dense_dense_0x8_rule.log", "./elsa_90_2x2_rule.log"]
        command = logs.extractfile("./elsa_90_2x2_rule.log").read().decode().splitlines()[0]
        assert command.startswith("$ ") and "launch/prune.py" in command and " --leaf_layers" in command
        config = command.split(" --deepspeed ")[1].split()[0]
        assert config.endswith("zero3_torch_linear.json") and "memory_efficient_linear" not in (ROOT / "ds_configs/zero3.json").read_text()
        assert json.loads(Path(config).read_text())["zero_optimization"]["memory_efficient_linear"] is False
    assert len(list((tmp_path / "OUT").iterdir())) <= 8
    assert (tmp_path / "OUT" / "curve.log").is_file() and not (tmp_path / "runs" / "work" / "elsa_90_2x2_rule").exists()
    listing = subprocess.run([sys.executable, "bench/device/curve.py", "--list", "--engine", "deepspeed", "--cells",
                              "dense:-:0,elsa:0.9:2:rule:2,wanda+ft:0.9:2",
                              "--seqlen", "32", "--results", str(tmp_path / "OUT" / "cells.jsonl")], cwd=ROOT, capture_output=True,
                             text=True, timeout=60)
    assert listing.stdout.split("\n")[:3] == ["done  dense|-|0x8x32|rule", "done  elsa|0.9|2x2x32|rule", "todo  wanda+ft|0.9|2x8x32|rule"]


@pytest.mark.integration
def test_quality_sh_runs_the_training_cells_in_the_plain_loop(packed, tmp_path):
    """The runner's default loop (--engine plain): ELSA and a retraining cell through bench/plain_cell.py with the flags
    launch/prune.py would get, their keys apart from the engine's cells, a one-shot cell as it was."""
    quality_sh_dry_run(packed, tmp_path, "--cells elsa:0.9:2:rule:2,wanda+ft:0.9:2:rule:2,wanda:0.9:0,elsa:0.9:2:rule:2:compiled")
    lines = {x["key"]: x for x in map(json.loads, (tmp_path / "OUT" / "cells.jsonl").read_text().splitlines())}
    assert set(lines) == {"elsa|0.9|2x2x32|rule|plain", "wanda+ft|0.9|2x2x32|rule|plain", "wanda|0.9|0x8x32|rule",
                          "elsa|0.9|2x2x32|rule|plain|compiled"}
    compiled = lines.pop("elsa|0.9|2x2x32|rule|plain|compiled")  # its model through inductor (here the host's C++)
    assert compiled["status"] == "ok" and compiled["compiled"] and math.isfinite(compiled["test_ppl"]), compiled.get("log_tail")
    assert compiled["compile"]["compile"] == "inductor" and compiled["compile"]["compiled_graphs"] >= 1, compiled["compile"]
    for key, line in lines.items():
        assert line["status"] == "ok" and math.isfinite(line["test_ppl"]), (key, line.get("log_tail"))
        assert line["engine"] == ("deepspeed" if line["kind"] == "oneshot" else "plain")
    elsa, wanda_ft = lines["elsa|0.9|2x2x32|rule|plain"], lines["wanda+ft|0.9|2x2x32|rule|plain"]
    for line in (elsa, wanda_ft):
        assert abs(line["overall_sparsity"] - 0.9) < 1e-3 and line["step_s"] > 0 and line["settings_used"]["lr"] > 0
        assert (line["leaf_layers"], line["memory_efficient_linear"]) == (False, None)
        # where the cell's time went, marked as the jobs mark it (the one-shot start inside "load")
        assert set(line["phase_s"]) == {"launch", "data", "load", "first step", "step", "export", "after"}, line["phase_s"]
        assert 0 < sum(line["phase_s"].values()) <= line["prune_s"] + 1
    assert elsa["settings_used"]["init_mask"] == "sparsegpt" and elsa["projections"][-1]["final"]  # the rule's start
    profile = elsa["profile"]  # step 0 under torch.profiler, step 1 under cProfile, with the engine's spans
    assert profile["torch"]["complete"] and set(profile["torch"]["spans_s"]) == set(SPANS) and profile["python"]["self_top"]
    with tarfile.open(tmp_path / "OUT" / "cell_logs.tgz") as logs:
        command = logs.extractfile("./elsa_90_2x2_rule_plain.log").read().decode().splitlines()[0]
    assert "bench/plain_cell.py" in command and "--leaf_layers" not in command and "--master_port" not in command


@pytest.mark.parametrize("new", ["leaf_layers", "torch_linear"])
def test_a_cell_that_fails_with_leaf_layers_runs_again_without_and_so_do_the_rest(tmp_path, monkeypatch, new):
    """Both are new on the GPU: should a training cell's prune fail with either (the other off), the loan's other cells
    must not all fail too. The failed line stays; the cell runs once more without both, and every cell started after it."""
    calls: list[tuple[str, bool]] = []

    def fake_cell(cell, run):
        on = run.leaf_layers or bool(run.torch_linear)
        calls.append((cell.method, on))
        line = {"key": cell.key(run.seqlen), "kind": cell.kind, "steps": cell.steps, "wall_s": 0.1,
                "leaf_layers": run.leaf_layers, "memory_efficient_linear": not run.torch_linear}
        return line | ({"status": "failed", "phase": "prune", "rc": 1} if on else {"status": "ok"})

    monkeypatch.setattr(curve, "run_cell", fake_cell)
    run = curve.Run("m", "t", "t", "t", 64, 64, "z", 4, tmp_path, time.time() + 600, 1, {},
                    leaf_layers=new == "leaf_layers", torch_linear="z_torch_linear.json" if new == "torch_linear" else "")
    cells = [curve.Cell("elsa", 0.9, 1), curve.Cell("wanda+ft", 0.9, 1)]
    estimator = estimate.Estimator("H", [], micro_batch=64, deepspeed=run.torch_linear or run.deepspeed,
                                   leaf_layers=run.leaf_layers, torch_linear=bool(run.torch_linear))
    lines, skipped = curve.schedule(cells, run, estimator, tmp_path / "cells.jsonl")
    assert calls == [("elsa", True), ("elsa", False), ("wanda+ft", False)] and not skipped
    assert [x["status"] for x in lines] == ["failed", "ok", "ok"] and not run.leaf_layers and not run.torch_linear
    assert estimator.deepspeed == "z" and curve.cell_config(cells[0], run) == "z"  # the later cells' peaks: as shipped
    assert not estimator.leaf_layers and not estimator.torch_linear  # and their seconds: from cells that stepped so
    ok = [json.loads(x) for x in (tmp_path / "cells.jsonl").read_text().splitlines()]
    assert [x["status"] for x in ok] == ["failed", "ok", "ok"]


def test_a_cell_that_fails_in_the_plain_loop_sends_it_and_the_rest_to_the_engine(tmp_path, monkeypatch):
    """The plain loop is new on the GPU: should a cell's prune fail in it, that cell and every cell not started yet run
    under launch/prune.py (their keys the engine's), the one-shot cells as they were; the failed line stays."""
    calls: list[str] = []

    def fake_cell(cell, run):
        calls.append(cell.key(run.seqlen))
        line = {"key": cell.key(run.seqlen), "kind": cell.kind, "steps": cell.steps, "wall_s": 0.1, "engine": cell.engine}
        return line | ({"status": "failed", "phase": "prune", "rc": 1} if cell.engine == "plain" else {"status": "ok"})

    monkeypatch.setattr(curve, "run_cell", fake_cell)
    run = curve.Run("m", "t", "t", "t", 64, 64, "z", 4, tmp_path, time.time() + 600, 1, {})
    cells = [replace(curve.Cell("elsa", 0.9, 1), engine="plain"), replace(curve.Cell("wanda+ft", 0.9, 1), engine="plain"),
             replace(curve.Cell("sparsegpt+ft", 0.9, 1), engine="plain"), curve.Cell("wanda", 0.9, 0)]
    estimator = estimate.Estimator("H", [], micro_batch=64, engine="plain")
    done = frozenset({"sparsegpt+ft|0.9|1x8x64|rule"})  # the engine measured it before: not again
    lines, skipped = curve.schedule(cells, run, estimator, tmp_path / "cells.jsonl", done)
    assert calls == ["elsa|0.9|1x8x64|rule|plain", "elsa|0.9|1x8x64|rule", "wanda+ft|0.9|1x8x64|rule", "wanda|0.9|0x8x64|rule"]
    assert [x["status"] for x in lines] == ["failed", "ok", "ok", "ok"] and not skipped and estimator.engine == "deepspeed"


def test_a_cell_that_fails_without_the_new_flags_too_gives_them_back_to_the_rest(tmp_path, monkeypatch):
    """An out-of-memory or a port race is not the new flags' fault: when the cell fails again without them, the cells
    after it take them again (a review: one unrelated failure cost a loan's later cells their faster steps)."""
    calls: list[tuple[str, bool]] = []

    def fake_cell(cell, run):
        calls.append((cell.method, run.leaf_layers))
        line = {"key": cell.key(run.seqlen), "kind": cell.kind, "steps": cell.steps, "wall_s": 0.1, "leaf_layers": run.leaf_layers}
        return line | ({"status": "failed", "phase": "prune", "rc": 1} if cell.method == "elsa" else {"status": "ok"})

    monkeypatch.setattr(curve, "run_cell", fake_cell)
    run = curve.Run("m", "t", "t", "t", 64, 64, "z", 4, tmp_path, time.time() + 600, 1, {}, leaf_layers=True)
    estimator = estimate.Estimator("H", [], micro_batch=64, deepspeed="z", leaf_layers=True)
    lines, _ = curve.schedule([curve.Cell("elsa", 0.9, 1), curve.Cell("wanda+ft", 0.9, 1)], run, estimator, tmp_path / "c.jsonl")
    assert calls == [("elsa", True), ("elsa", False), ("wanda+ft", True)] and run.leaf_layers and estimator.leaf_layers


@pytest.mark.parametrize("shape", curve.LONG)
def test_the_many_steps_retraining_waits_for_its_elsa_cell_and_a_cut_cell_is_priced_at_least_its_time(tmp_path, monkeypatch,
                                                                                                         shape):
    started: list[str] = []
    monkeypatch.setattr(curve, "run_cell", lambda cell, run: started.append(cell.method) or {
        "key": cell.key(run.seqlen), "kind": cell.kind, "steps": cell.steps, "wall_s": 0.1, "status": "ok"})
    steps, batch = shape
    cells = [curve.Cell(m, 0.9, steps, batch=batch) for m in ("elsa", "sparsegpt+ft", "wanda+ft")]
    line = {"device": "H", "status": "ok", "kind": "train", "method": "wanda+ft", "settings": "rule", "steps": 100,
            "batch": 8, "seqlen": 512, "step_s": 0.2, "wall_s": 100.0 + 20.0}
    cut = {"device": "H", "status": "cut", "key": cells[0].key(512), "kind": "train", "wall_s": 5000.0}
    estimator = estimate.Estimator("H", [line, cut], micro_batch=32, model=None, seqlen=512)
    assert estimator.seconds(cells[0], 4) == 5000.0  # cut once at a loan's deadline: it needs more than it had
    assert estimator.seconds(cells[2], 4) == pytest.approx(100.0 + steps * 0.2)
    run = curve.Run("m", "t", "t", "t", 512, 32, "z", 4, tmp_path, time.time() + 1000, 4, {})
    _, skipped = curve.schedule(cells, run, estimator, tmp_path / "c.jsonl")
    assert started == [] and len(skipped) == 3  # the retraining cells would fit, but not ELSA's: none starts
    assert estimator.gpu_bytes(curve.Cell("elsa", 0.9, 1)) == 0.0  # no model: nothing predicted


def test_an_elsa_cells_gpu_peak_is_priced_from_elsa_cells_or_the_prior():
    def line(method, ratio):
        return {"device": "H", "status": "ok", "kind": "train", "method": method, "steps": 1, "peak_gpu_bytes": ratio * 1e9,
                "est_gpu_bytes": 1e9}

    est = estimate.Estimator("H", [line("wanda+ft", 0.9)], model=str(DEMO_MODEL_DIR), seqlen=64)
    elsa, wanda = curve.Cell("elsa", 0.9, 10), curve.Cell("wanda+ft", 0.9, 10)
    assert est.gpu_bytes(elsa) == pytest.approx(estimate.PRIOR_GPU_RATIO * est.estimate(elsa))  # retraining's says less
    assert est.gpu_bytes(wanda) == pytest.approx(0.9 * est.estimate(wanda))
    est.add(line("elsa", 1.05))
    assert est.gpu_bytes(elsa) == pytest.approx(1.05 * est.estimate(elsa))


def test_a_call_cut_while_it_follows_the_runner_still_returns_the_cells_that_ended(tmp_path):
    """quality.sh copies the runner's lines and log to $OUT as they come, and once more when the device tool's limit
    stops the call (a review: only the call's normal end copied them, so a cut wait brought back none)."""
    runs, out = tmp_path / "runs", tmp_path / "OUT"
    runs.mkdir()
    runner = subprocess.Popen(["sleep", "60"])
    try:
        (runs / "pid").write_text(str(runner.pid))
        (runs / "log").write_text("[curve] start a\n")
        (runs / "cells.jsonl").write_text('{"key": "a", "status": "ok"}\n')
        env = {**os.environ, "ELSA_CURVE": str(runs), "OUT": str(out), "ELSA_SHIP": str(tmp_path / "ship")}
        follow = subprocess.Popen(["bash", "bench/device/quality.sh", "--dry-run", "wait", "50"], cwd=ROOT, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 30
        while not (out / "cells.jsonl").is_file() and time.time() < deadline:
            time.sleep(0.5)
        assert (out / "cells.jsonl").read_text() == '{"key": "a", "status": "ok"}\n'  # while the call goes on
        with (runs / "cells.jsonl").open("a") as fh:
            fh.write('{"key": "b", "status": "ok"}\n')
        follow.terminate()  # the tool's limit
        stdout, _ = follow.communicate(timeout=30)
        assert follow.returncode == 143 and "start a" in stdout
        assert [json.loads(x)["key"] for x in (out / "cells.jsonl").read_text().splitlines()] == ["a", "b"]
        assert (out / "curve.log").read_text() == "[curve] start a\n" and not list(out.glob("*.part"))
    finally:
        runner.kill()
        runner.wait()

def test_the_torch_linear_config_is_read_as_elsa_prune_reads_a_name_or_a_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # neither a shipped name nor a path relative to the checkout depends on the directory
    for given in ("zero3", str(ROOT / "ds_configs" / "zero3_offload.json")):
        path = curve.torch_linear_config(given, Path("work_" + Path(given).stem).resolve().parent)
        assert path.is_absolute() and path.is_file()
        zero = json.loads(path.read_text())["zero_optimization"]
        assert zero["memory_efficient_linear"] is False and zero["stage"] == 3
    with pytest.raises(curve.ElsaError, match="no_such_config"):  # main says it in one line, exit 2, before any cell
        curve.torch_linear_config("no_such_config", tmp_path)


def _paced_line(step_s: float, sharing: float | None, steps: int = 10) -> dict:
    """A finished ELSA cell of the estimator's default regime, no overhead: its whole wall was its steps."""
    line = {"device": "H", "status": "ok", "kind": "train", "method": "elsa", "settings": "rule", "steps": steps, "batch": 8,
            "seqlen": 64, "step_s": step_s, "wall_s": steps * step_s, "gradient_checkpointing": False,
            "leaf_layers": False, "engine": "deepspeed"}
    return line | ({"sharing": sharing} if sharing is not None else {})


def test_a_cells_steps_are_paced_for_the_cells_that_share_the_gpu():
    """A line that recorded the mean number of cells beside it prices the next cell's steps for as many as will share the
    GPU (4 sharing at 0.4 s a step: 0.1 alone, 0.2 beside one); a line without it counts as measured, whatever shares."""
    cell = curve.Cell("elsa", 0.9, 100)
    paced = estimate.Estimator("H", [_paced_line(0.4, 4.0)], micro_batch=8, seqlen=64)
    assert paced.steps_s(cell, 1) == pytest.approx(100 * 0.1) and paced.steps_s(cell, 2) == pytest.approx(100 * 0.2)
    assert paced.seconds(cell, 3) == pytest.approx(paced.overhead_s(cell) + 100 * 0.3)
    host_bound = _paced_line(0.4, 4.0) | {"profile": {"torch": {"host_ops_s": 0.25}}}  # 0.25 s of it on the host
    floor = estimate.Estimator("H", [host_bound], micro_batch=8, seqlen=64)
    assert floor.steps_s(cell, 1) == pytest.approx(100 * 0.25) and floor.steps_s(cell, 4) == pytest.approx(100 * 0.4)
    measured = estimate.Estimator("H", [_paced_line(0.4, None)], micro_batch=8, seqlen=64)
    assert measured.steps_s(cell, 1) == measured.steps_s(cell, 4) == pytest.approx(100 * 0.4)
    assert paced.steps_s(curve.Cell("sparsegpt", 0.9, 0), 2) == 0.0


def test_a_cell_starts_only_where_it_and_the_running_ones_still_end_in_time():
    """Shares: with one cell running, a second starts only if both still end before the deadline at the pace of two; as
    time passes the running cell's steps left shrink at the pace of the cells beside it."""
    est = estimate.Estimator("H", [_paced_line(1.0, 1.0)], micro_batch=8, seqlen=64)
    a, b = curve.Cell("elsa", 0.9, 10), curve.Cell("elsa", 0.7, 10)  # 10 s alone, 20 s beside another
    shares = curve.Shares(est, 0.0)
    assert shares.admits(a, 15.0)
    shares.start(a, 0.0)
    assert not shares.admits(b, 15.0) and shares.admits(b, 20.0)
    shares.start(b, 0.0)
    shares.tick(10.0)  # two cells for 10 s: half of each one's steps done
    assert shares.remaining(a, 2) == pytest.approx(10.0) and shares.remaining(a, 1) == pytest.approx(5.0)
    assert shares.end(a, 10.0) == pytest.approx(2.0)  # its life beside b throughout
    shares.tick(15.0)  # alone now: 5 s finish b's other half
    assert shares.remaining(b, 1) == pytest.approx(0.0) and shares.end(b, 20.0) == pytest.approx(20 / (10 / 2 + 10 / 1), abs=1e-3)
    late, c = curve.Shares(est, 0.0), curve.Cell("elsa", 0.8, 10)
    late.start(a, 0.0)
    late.tick(30.0)  # still running at 30 s against 10 s predicted: nothing starts beside it, whatever the time left
    assert late.remaining(a, 2) == 0.0 and not late.admits(c, 1000.0)
    est.add(_paced_line(1.0, 1.0) | {"key": b.key(64), "status": "cut", "wall_s": 40.0})  # b took 40 s before a deadline cut it
    again = curve.Shares(est, 0.0)
    assert not again.admits(b, 35.0) and again.admits(b, 45.0)
    again.start(b, 0.0)
    assert again.remaining(b, 1) == pytest.approx(40.0) and not again.admits(c, 45.0)  # b's 40 s beside c: past 45


def test_the_runner_runs_apart_what_cannot_share_the_gpu_in_time(tmp_path, monkeypatch):
    """Two cells that each fit what is left alone but not beside each other run one after the other, each recording
    ``sharing`` 1; with time for both at once they run together."""
    started: list[int] = []
    running: set[str] = set()

    def fake_cell(cell, run):
        running.add(cell.key(run.seqlen))
        started.append(len(running))
        time.sleep(0.3)
        running.discard(cell.key(run.seqlen))
        return {"key": cell.key(run.seqlen), "status": "ok", "kind": cell.kind, "steps": cell.steps, "wall_s": 0.3}

    monkeypatch.setattr(curve, "run_cell", fake_cell)
    cells = [curve.Cell("elsa", 0.9, 10), curve.Cell("elsa", 0.7, 10)]
    for left, together in ((15.0, False), (30.0, True)):
        started.clear()
        est = estimate.Estimator("H", [_paced_line(1.0, 1.0)], micro_batch=8, seqlen=64)
        run = curve.Run("m", "t", "t", "t", 64, 64, "z", 4, tmp_path, time.time() + left + curve.MARGIN_S, 2, {})
        lines, skipped = curve.schedule(cells, run, est, tmp_path / f"cells{left}.jsonl")
        assert not skipped and len(lines) == 2 and (started == [1, 2]) == together and (started == [1, 1]) != together
        assert all((x["sharing"] > 1.5) == together for x in lines)


def test_sharing_is_derived_from_a_runners_log_and_the_backfilled_lines_agree():
    """sharing_from_log: each finished cell's mean number of cells on the GPU, from its start line's seconds left and its
    end line's wall; every recorded line that took its ``sharing`` from a log finds the same value there."""
    log = "\n".join(["[curve] start a|0.9 (estimate 9 s, 100 s left)", "[curve] start b|0.9 (estimate 9 s, 100 s left)",
                     "[curve] ok     a|0.9: test 1.0, linux-doc 2.0, 50.0 s", "[curve] start c|0.9 (estimate 9 s, 50 s left)",
                     "[curve] ok     b|0.9: test 1.0, linux-doc 2.0, 80.0 s", "[curve] failed c|0.9: test None, linux-doc None, 40.0 s",
                     "[curve] start d|0.9 (estimate 9 s, 5 s left)"])
    assert curve.sharing_from_log(log) == {("a|0.9", 50.0): 2.0, ("b|0.9", 80.0): 2.0, ("c|0.9", 40.0): 1.6}
    assert curve.sharing_from_log("[curve] ok     x|0.9: test 1.0, linux-doc 2.0, 5.0 s\n" + log) == curve.sharing_from_log(log)
    recorded = [x for x in ship.read_lines(ship.RESULTS) if x.get("sharing_from")]
    assert recorded, "the plain cells run before 2026-12-04 17:40 carry their sharing from the runner's logs"
    for line in recorded:
        assert curve.sharing_from_log((ROOT / line["sharing_from"]).read_text())[(line["key"], line["wall_s"])] == line["sharing"]


def test_a_loan_is_played_on_the_estimates_before_it_is_spent(tmp_path, capsys):
    """simulate: the runner's schedule on its estimates alone (two 10 s cells: together where both end in time, else one
    and the other left out); --simulate prints the same for the recorded cells and runs nothing."""
    est = estimate.Estimator("H", [_paced_line(1.0, 1.0)], micro_batch=8, seqlen=64)
    a, b = curve.Cell("elsa", 0.9, 10), curve.Cell("elsa", 0.7, 10)
    started, left = curve.simulate([a, b], est, 45.0, 4, None, 64)
    assert [(r["start_s"], r["end_s"], r["sharing"]) for r in started] == [(0.0, 20.0, 2.0)] * 2 and not left
    started, left = curve.simulate([a, b], est, 35.0, 4, None, 64)
    assert [(r["key"], r["end_s"]) for r in started] == [(a.key(64), 10.0)] and left == [b.key(64)]
    results = tmp_path / "r.jsonl"
    results.write_text(json.dumps(_paced_line(1.0, 1.0) | {"key": "x"}) + "\n")
    assert curve.main(["--simulate", "H", "--results", str(results), "--budget_s", "45", "--seqlen", "64", "--micro_batch", "8",
                       "--cells", "elsa:0.9:10,elsa:0.7:10", "--no-torch_linear", "--engine", "deepspeed",
                       "--no-leaf_layers"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["would_start"] == [a.key(64), b.key(64)] and summary["would_not"] == []


def test_a_compiled_cell_runs_the_plain_loop_compiled_and_is_priced_as_eager_until_one_is_measured(tmp_path):
    """``compiled``: the plain loop's model through inductor (bench/plain_cell.py --compile), its key and slug apart from
    the eager cell's; until a compiled cell has ended its steps are priced as the eager loop's (an upper bound where the
    compile pays) and its overhead as the largest of any training cell (its compile is not in the eager ones'); then its
    own; the eager cells' prices do not move."""
    cell = curve.parse_cell("elsa:0.9:2048:rule:8:compiled")
    assert cell == curve.Cell("elsa", 0.9, 2048, compiled=True) and cell.key(512).endswith("|rule|compiled")
    plain = replace(cell, engine="plain")
    assert plain.key(512) == "elsa|0.9|2048x8x512|rule|plain|compiled" and plain.slug() == "elsa_90_2048x8_rule_plain_compiled"
    for wrong in ("wanda:0.9:0:rule:8:compiled", "elsa:0.9:10:rule:8:fast"):
        with pytest.raises(ValueError):
            curve.parse_cell(wrong)
    run = curve.Run("m", "t", "t", "t", 512, 32, "ds_configs/zero3.json", 4, tmp_path, time.time() + 600, 1, {})
    command = curve.plain_command(plain, run, tmp_path / "out")
    assert command[1].endswith("bench/plain_cell.py") and command[2:4] == ["--compile", "inductor"]
    assert "--compile" not in curve.plain_command(replace(plain, compiled=False), run, tmp_path / "out")
    eager_line = {"device": "H", "status": "ok", "kind": "train", "method": "elsa", "settings": "rule", "steps": 100, "batch": 8,
                  "seqlen": 512, "step_s": 0.3, "wall_s": 100 * 0.3 + 30.0, "engine": "plain", "gradient_checkpointing": False}
    other = eager_line | {"method": "wanda+ft", "step_s": 0.2, "wall_s": 100 * 0.2 + 90.0}  # the largest overhead: 90 s
    est = estimate.Estimator("H", [eager_line, other], micro_batch=32, model=None, seqlen=512, engine="plain")
    compiled = replace(plain, steps=100)  # the measured cells' steps: the same start (the rule's SparseGPT start)
    eager = replace(compiled, compiled=False)
    assert est.steps_s(compiled, 1) == est.steps_s(eager, 1) == pytest.approx(100 * 0.3)
    assert est.overhead_s(eager) == pytest.approx(30.0) and est.overhead_s(compiled) == pytest.approx(90.0)
    est.add(eager_line | {"compiled": True, "step_s": 0.1, "wall_s": 100 * 0.1 + 60.0})
    assert est.steps_s(compiled, 1) == pytest.approx(100 * 0.1) and est.overhead_s(compiled) == pytest.approx(60.0)
    assert est.steps_s(eager, 1) == pytest.approx(100 * 0.3) and est.overhead_s(eager) == pytest.approx(30.0)
    assert estimate.regime(eager_line | {"compiled": True})[3] == "plain+compiled"


def test_cells_are_priced_by_their_loss_the_fused_ones_as_chunked_until_one_is_measured(monkeypatch):
    """The Triton loss (elsa_ds/loss.py, 2026-12-05) makes a wide step cheaper by an amount no GPU had measured: every
    training cell takes it, priced as the chunked loss's until a cell with it has ended, then as their own; a line says
    which loss ran (``loss``), and lines without it ran transformers' loss, the slowest: priced from only where nothing
    newer stepped as the cell will."""
    chunked = {"device": "H", "status": "ok", "kind": "train", "method": "elsa", "settings": "rule", "steps": 100, "batch": 32,
               "seqlen": 512, "step_s": 0.6, "wall_s": 100 * 0.6 + 30.0, "engine": "plain", "gradient_checkpointing": False,
               "loss": "chunked", "compiled": True}
    older = chunked | {"step_s": 0.9, "wall_s": 100 * 0.9 + 30.0}
    del older["loss"]
    cell = curve.Cell("elsa", 0.9, 100, batch=32, engine="plain", compiled=True)
    eager = replace(cell, compiled=False)
    monkeypatch.delenv("ELSA_DS_LOSS", raising=False)
    assert estimate.loss_of(cell) == estimate.loss_of(eager) == estimate.FUSED
    assert estimate.Estimator("H", [older], model=None, seqlen=512, engine="plain").steps_s(cell, 1) == pytest.approx(90.0)
    est = estimate.Estimator("H", [older, chunked], model=None, seqlen=512, engine="plain")
    assert estimate.regime(chunked)[3:] == ("plain+compiled", "chunked")
    assert est.steps_s(cell, 1) == pytest.approx(60.0)  # the chunked loss's: transformers' older cell no longer counts
    fused = chunked | {"loss": "fused", "step_s": 0.4, "wall_s": 100 * 0.4 + 30.0}
    est.add(fused)
    assert est.steps_s(cell, 1) == pytest.approx(40.0)
    monkeypatch.setenv("ELSA_DS_LOSS", "chunked")  # the run keeps the chunks everywhere: priced by the chunked cells alone
    assert estimate.loss_of(cell) == estimate.loss_of(eager) == estimate.CHUNKED
    assert est.steps_s(cell, 1) == pytest.approx(60.0)


def test_a_compiled_cell_that_fails_runs_again_uncompiled_and_so_do_the_compiled_ones_after_it(tmp_path, monkeypatch):
    """Compiling is new on the GPU: should a compiled cell's prune fail, it and every compiled cell not started yet run in
    the plain loop uncompiled (a graph that does not compile runs eagerly already: this is a failure past that), not on
    the engine; an uncompiled cell recorded before is not run again; the failed line stays."""
    monkeypatch.setenv(LOSS_ENV, "auto")  # a fallback sets the runner's ELSA_DS_LOSS: undone after
    calls: list[str] = []

    def fake_cell(cell, run):
        calls.append(cell.key(run.seqlen))
        line = {"key": cell.key(run.seqlen), "kind": cell.kind, "steps": cell.steps, "wall_s": 0.1, "engine": cell.engine}
        return line | ({"status": "failed", "phase": "prune", "rc": 1} if cell.compiled else {"status": "ok"})

    monkeypatch.setattr(curve, "run_cell", fake_cell)
    run = curve.Run("m", "t", "t", "t", 64, 64, "z", 4, tmp_path, time.time() + 600, 1, {})
    cells = [curve.Cell(m, 0.9, 1, engine="plain", compiled=True) for m in ("elsa", "wanda+ft", "sparsegpt+ft")]
    estimator = estimate.Estimator("H", [], micro_batch=64, engine="plain")
    done = frozenset({"sparsegpt+ft|0.9|1x8x64|rule|plain"})
    lines, skipped = curve.schedule(cells, run, estimator, tmp_path / "cells.jsonl", done)
    assert calls == ["elsa|0.9|1x8x64|rule|plain|compiled", "elsa|0.9|1x8x64|rule|plain", "wanda+ft|0.9|1x8x64|rule|plain"]
    assert [x["status"] for x in lines] == ["failed", "ok", "ok"] and not skipped and estimator.engine == "plain"
    assert os.environ[LOSS_ENV] == "chunked"  # the Triton loss a suspect too: the rest of the run trains with the chunks


@pytest.mark.parametrize("chunks_fail", [False, True])
def test_a_cell_that_fails_with_the_triton_loss_runs_again_with_the_chunks_before_any_other_fallback(
        tmp_path, monkeypatch, chunks_fail):
    """The Triton loss is new on the GPU (2026-12-05): an eager cell whose training fails with it runs again in the same
    loop with torch's chunks, and so does every cell after it (ELSA_DS_LOSS=chunked for the rest of the run); only a
    failure with the chunks too sends the cells to the engine. Its failed line stays, naming the loss it asked for."""
    monkeypatch.setenv(LOSS_ENV, "auto")
    calls: list[tuple[str, str]] = []

    def fake_cell(cell, run):
        loss = estimate.loss_of(cell)
        calls.append((cell.key(run.seqlen), loss))
        failing = cell.engine == "plain" and (loss == "fused" or chunks_fail)
        line = {"key": cell.key(run.seqlen), "kind": cell.kind, "steps": cell.steps, "wall_s": 0.1, "engine": cell.engine,
                "loss": loss}
        return line | ({"status": "failed", "phase": "prune", "rc": 1} if failing else {"status": "ok"})

    monkeypatch.setattr(curve, "run_cell", fake_cell)
    run = curve.Run("m", "t", "t", "t", 64, 64, "z", 4, tmp_path, time.time() + 600, 1, {})
    estimator = estimate.Estimator("H", [], micro_batch=64, engine="plain")
    cells = [curve.Cell(m, 0.9, 1, engine="plain") for m in ("elsa", "wanda+ft")]
    lines, skipped = curve.schedule(cells, run, estimator, tmp_path / "cells.jsonl")
    first = [("elsa|0.9|1x8x64|rule|plain", "fused"), ("elsa|0.9|1x8x64|rule|plain", "chunked")]
    if chunks_fail:
        assert calls == [*first, ("elsa|0.9|1x8x64|rule", "chunked"), ("wanda+ft|0.9|1x8x64|rule", "chunked")]
        assert [x["status"] for x in lines] == ["failed", "failed", "ok", "ok"] and estimator.engine == "deepspeed"
    else:
        assert calls == [*first, ("wanda+ft|0.9|1x8x64|rule|plain", "chunked")]
        assert [x["status"] for x in lines] == ["failed", "ok", "ok"] and estimator.engine == "plain"
    assert lines[0]["loss"] == "fused" and not skipped and os.environ[LOSS_ENV] == "chunked"


@pytest.mark.parametrize("fails", ["compiled", "plain"])
def test_a_fallback_never_runs_a_cell_twice_when_a_compiled_cell_has_an_eager_twin(tmp_path, monkeypatch, fails):
    """A review (2026-12-04): the plan's compiled 128 x 8 ELSA cell is the eager one's twin; a fallback (uncompiled, or
    the engine) made them one key, and the cell ran again though its line had ended ok in the same run (or both twins
    became the same engine cell). Now a fallback skips keys ended ok in this run, running or recorded, and a second cell
    of one key; ``--engine deepspeed`` plans one cell of each key."""
    monkeypatch.setenv(LOSS_ENV, "auto")  # a fallback sets the runner's ELSA_DS_LOSS: undone after
    calls: list[str] = []

    def fake_cell(cell, run):
        calls.append(cell.key(run.seqlen))
        failing = cell.compiled if fails == "compiled" else cell.engine == "plain" and not cell.compiled
        line = {"key": cell.key(run.seqlen), "kind": cell.kind, "steps": cell.steps, "wall_s": 0.1, "engine": cell.engine}
        return line | ({"status": "failed", "phase": "prune", "rc": 1} if failing else {"status": "ok"})

    monkeypatch.setattr(curve, "run_cell", fake_cell)
    run = curve.Run("m", "t", "t", "t", 64, 64, "z", 4, tmp_path, time.time() + 600, 1, {})
    eager = curve.Cell("elsa", 0.9, 1, engine="plain")
    cells = [eager, curve.Cell("wanda+ft", 0.9, 1, engine="plain"), replace(eager, compiled=True)]
    curve.schedule(cells, run, estimate.Estimator("H", [], micro_batch=64, engine="plain"), tmp_path / "cells.jsonl")
    assert len(calls) == len(set(calls)), calls
    if fails == "compiled":
        assert calls == ["elsa|0.9|1x8x64|rule|plain", "wanda+ft|0.9|1x8x64|rule|plain", "elsa|0.9|1x8x64|rule|plain|compiled"]
    else:
        assert calls == ["elsa|0.9|1x8x64|rule|plain", "elsa|0.9|1x8x64|rule", "wanda+ft|0.9|1x8x64|rule"]
    proc = subprocess.run([sys.executable, str(ROOT / "bench/device/curve.py"), "--list", "--engine", "deepspeed", "--results",
                           str(tmp_path / "none.jsonl")], capture_output=True, text=True, timeout=120)
    keys = [line.split()[1] for line in proc.stdout.splitlines()]
    assert proc.returncode == 0 and keys and len(keys) == len(set(keys)) and not any("compiled" in k for k in keys)


def test_a_cell_trains_with_the_loss_it_is_priced_by_and_every_evaluation_sums_alike(tmp_path, monkeypatch):
    """curve.run_cell's environment: a training cell, compiled or not, may take the Triton loss (its line, failed before
    a report said which ran, names the one asked for); ELSA_DS_LOSS=chunked for the run keeps every cell on the chunks;
    every evaluation sums its perplexity as the chunks do."""
    calls = []
    monkeypatch.setattr(curve, "call", lambda cmd, log, deadline, env=None: calls.append((cmd, dict(env or {}))) or 1)
    run = curve.Run("m", "t", "t", "t", 512, 32, "ds_configs/zero3.json", 4, tmp_path, time.time() + 600, 1, {})
    monkeypatch.delenv(LOSS_ENV, raising=False)
    for run_loss, loss in ((None, "auto"), ("chunked", "chunked")):
        if run_loss:
            monkeypatch.setenv(LOSS_ENV, run_loss)
        for compiled in (True, False):
            line = curve.run_cell(curve.Cell("elsa", 0.9, 10, engine="plain", compiled=compiled), run)
            assert line["status"] == "failed" and calls[-1][0][1].endswith("bench/plain_cell.py")
            assert calls[-1][1][LOSS_ENV] == loss and line["loss"] == {"auto": "fused"}.get(loss, loss)
    curve.run_cell(curve.Cell("dense", None, 0), run)
    assert calls[-1][0][1].endswith("launch/evaluate.py") and calls[-1][1] == {LOSS_ENV: "chunked"}


def test_a_cell_two_fallbacks_requeue_runs_once_more_and_the_parallel_runner_goes_on(tmp_path, monkeypatch):
    """A review (2026-12-05): an engine cell that failed with the Triton loss and the new flags was queued again by both
    the loss's fallback and the flags' one; run twice beside itself it crashed the parallel runner. Now once more, with
    the chunks and without the flags."""
    monkeypatch.setenv(LOSS_ENV, "auto")
    calls: list[tuple[str, str]] = []

    def fake_cell(cell, run):
        loss = estimate.loss_of(cell)
        calls.append((cell.key(run.seqlen), loss))
        line = {"key": cell.key(run.seqlen), "kind": cell.kind, "steps": cell.steps, "wall_s": 0.1, "engine": cell.engine,
                "loss": loss, "leaf_layers": run.leaf_layers}
        return line | ({"status": "failed", "phase": "prune", "rc": 1} if loss == "fused" else {"status": "ok"})

    monkeypatch.setattr(curve, "run_cell", fake_cell)
    run = curve.Run("m", "t", "t", "t", 64, 64, "z", 4, tmp_path, time.time() + 600, 2, {}, leaf_layers=True)
    lines, skipped = curve.schedule([curve.Cell("elsa", 0.9, 1, engine="deepspeed")], run,
                                    estimate.Estimator("H", [], micro_batch=64), tmp_path / "cells.jsonl")
    assert calls == [("elsa|0.9|1x8x64|rule", "fused"), ("elsa|0.9|1x8x64|rule", "chunked")]
    assert [x["status"] for x in lines] == ["failed", "ok"] and not skipped and not run.leaf_layers
