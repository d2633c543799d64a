"""Files from elsewhere cannot take more memory than they hold, nor crash a reader: crafted sizes and depths.

A small file could make a reader allocate gigabytes (a zip entry stored compressed, a tensor view repeating its storage,
a 1 GB ``latest``) or raise a raw RecursionError (50 kB of ``[``); a packed mask file's bytes could disagree with the
shape it claims. Each case here is a small crafted file fed to the real reader, which must refuse it in one ElsaError
(or its own ValueError, for the helpers) before it reads more than the file holds.
"""
from __future__ import annotations

import io
import json
import os
import pickle
import re
import shutil
import struct
import zipfile
import zlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from elsa_ds import json_data
from elsa_ds.errors import ElsaError
from elsa_ds.evaluation.tables import load_result
from elsa_ds.files import torch_files
from elsa_ds.files.mask_file import MaskReader, write_masks
from elsa_ds.files.weight_files import check_weight_files, read_header, read_index
from elsa_ds.settings.config_files import load_profile, read_json_object
from elsa_ds.sparse.compress import compress
from elsa_ds.sparse.integrity import SparseCheckpointError
from elsa_ds.sparse.loader import verify
from elsa_ds.zero.checkpoint import UnsafeCheckpointError, check_resume, read_checkpoint_file, read_fingerprint, resume_order

DEEP = "[" * 50_000  # deeper than Python's stack: json.loads raises RecursionError


def _folder_with(folder: Path, file: Path, name: str) -> Path:
    """A model folder holding ``file`` as ``name``."""
    folder.mkdir()
    shutil.copy(file, folder / name)
    return folder


def test_json_data_refuses_depth_and_size_as_value_errors(tmp_path):
    with pytest.raises(ValueError, match="nested too deeply"):
        json_data.loads(DEEP)
    big = tmp_path / "big.json"
    with big.open("wb") as fh:  # a sparse file: 65 MiB claimed, nothing written
        fh.truncate(json_data.MAX_BYTES + 1)
    with pytest.raises(ValueError, match="more than the"):
        json_data.read(big)
    (tmp_path / "ok.json").write_text('{"a": [1, 2]}')
    assert json_data.read(tmp_path / "ok.json") == {"a": [1, 2]}


def test_a_small_file_read_under_a_large_cap_reserves_no_more_than_it_holds(tmp_path):
    """An audit (OS limits, 2026-12-07): ``read(limit + 1)`` reserved the whole cap (256 MiB for a model's JSON files)
    before reading a byte, so a 260 KB tokenizer.json failed with MemoryError under ``ulimit -v``."""
    import subprocess
    import sys

    from elsa_ds.regular_file import read_at_most

    assert read_at_most(io.BytesIO(b"abcdef"), 4, piece=3) == b"abcd" and read_at_most(io.BytesIO(b"ab"), 9) == b"ab"
    (tmp_path / "small.json").write_text('{"a": 1}')
    script = f"""
import resource
from elsa_ds import json_data
with open("/proc/self/status") as fh:
    size = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (size + (256 << 20), resource.getrlimit(resource.RLIMIT_AS)[1]))
print(json_data.read({str(tmp_path / "small.json")!r}, limit=1 << 30))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "{'a': 1}", proc.stderr[-2000:]


def test_every_json_reader_turns_deep_nesting_into_its_own_error(tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text(DEEP)
    with pytest.raises(ElsaError, match="not valid JSON"):
        read_json_object(deep, "recipe", "a hint")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_profile(deep)
    with pytest.raises(ElsaError, match="not a readable JSON file"):
        load_result(deep)
    with pytest.raises(ElsaError, match="not a valid shard index"):
        read_index(deep, ElsaError)
    (tmp_path / "ckpt").mkdir()
    shutil.copy(deep, tmp_path / "ckpt" / "elsa_fingerprint.json")
    assert read_fingerprint(tmp_path / "ckpt") is None  # unreadable: the client state's own check runs later
    header = tmp_path / "model.safetensors"
    header.write_bytes(struct.pack("<Q", len(DEEP)) + DEEP.encode())
    with pytest.raises(ValueError, match="not valid JSON"):
        read_header(header)
    with pytest.raises(ElsaError, match="damaged"):
        check_weight_files(_folder_with(tmp_path / "model", header, "model.safetensors"), "model x")


def _sparse_checkpoint(root: Path) -> Path:
    dense = root / "dense"
    dense.mkdir(parents=True)
    w = torch.randn(16, 64)
    w[torch.rand_like(w) < 0.7] = 0
    save_file({"a.weight": w, "norm": torch.ones(16)}, str(dense / "model.safetensors"))
    (dense / "config.json").write_text(json.dumps({"model_type": "llama"}))
    compress(dense, root / "sparse")
    return root / "sparse"


def test_a_sparse_checkpoint_whose_config_is_too_deep_or_too_large_is_refused_before_it_is_read(tmp_path):
    sparse = _sparse_checkpoint(tmp_path)
    (sparse / "config.json").write_text(DEEP)
    with pytest.raises(SparseCheckpointError, match="not valid JSON.*nested too deeply"):
        verify(sparse)
    with (sparse / "config.json").open("wb") as fh:
        fh.truncate(2**30)  # 1 GiB claimed: refused from its size alone, by the folder's check
    with pytest.raises(SparseCheckpointError, match="config.json holds 1,073,741,824 bytes, more than any model's JSON"):
        verify(sparse)


def _as_bin(sparse: Path, **replace: torch.Tensor) -> dict:
    """The checkpoint's tensors (``replace`` put in), its safetensors file gone: a version 2 checkpoint (the last whose
    weights could be a pytorch_model.bin) once they are saved as one."""
    from safetensors.torch import load_file

    from tests.sparse.conftest import as_model_named

    state = load_file(str(as_model_named(sparse, version=2) / "model.safetensors")) | replace
    (sparse / "model.safetensors").unlink()
    return state


def test_a_tensor_view_repeating_its_storage_is_refused_not_inflated(tmp_path):
    sparse = _sparse_checkpoint(tmp_path)
    state = _as_bin(sparse, norm=torch.zeros(1).expand(2**28))  # 1 GiB claimed over 4 bytes
    torch.save(state, sparse / "pytorch_model.bin")
    assert (sparse / "pytorch_model.bin").stat().st_size < 20_000
    with pytest.raises(SparseCheckpointError, match="claims 1,073,741,824 bytes over a storage of 4"):
        verify(sparse)
    path = tmp_path / "state.pt"
    torch.save({"optimizer": {"state": [torch.ones(3), torch.zeros(2).expand(8, 2)]}}, path)
    with pytest.raises(UnsafeCheckpointError, match=r"\['state'\]\[1\] claims 64 bytes over a storage of 8"):
        read_checkpoint_file(path)
    torch.save({"optimizer": {"state": [torch.ones(3), torch.arange(8.0)[::2]]}}, path)  # a real view: smaller than its storage
    assert read_checkpoint_file(path)["optimizer"]["state"][1].tolist() == [0.0, 2.0, 4.0, 6.0]


def test_a_pickle_sharing_one_container_many_times_or_holding_itself_is_walked_once(tmp_path):
    """A walk (2026-12-02): a 31 KB checkpoint file whose pickle shares one list 64 levels deep (x = [x, x]: 2^64 paths)
    kept the resume's check of its tensors running for years; a list holding itself never ended."""
    import time

    shared: list = [torch.ones(2)]
    for _ in range(64):
        shared = [shared, shared]
    cycle: list = [torch.ones(1)]
    cycle.append(cycle)
    path = tmp_path / "shared.pt"
    torch.save({"shared": shared, "cycle": cycle}, path)
    started = time.time()
    loaded = read_checkpoint_file(path)
    assert time.time() - started < 10 and loaded["cycle"][1] is loaded["cycle"]
    torch.save({"shared": shared, "late": [shared, torch.zeros(1).expand(100)]}, path)  # still found behind them
    with pytest.raises(UnsafeCheckpointError, match=r"late\[1\] claims 400 bytes over a storage of 4"):
        read_checkpoint_file(path)


def test_a_pickle_larger_than_any_torch_save_of_a_state_writes_is_refused_before_it_is_unpickled(tmp_path, monkeypatch):
    """A walk (2026-12-02): a 20 MB torch zip whose pickle builds ten million empty lists passed every check and took
    3.4 GB and 46 s to read (~170x its size). A pickle past ``MAX_PICKLE_BYTES`` (2.6 MB holds 20,000 tensors' records)
    is refused from the zip's directory, before anything unpacks it: resumed checkpoints, model folders, sparse shards."""
    import time

    monkeypatch.setattr(torch_files, "MAX_PICKLE_BYTES", 2**20)  # the rule at a smaller size: a 1.2 MB file, not 17 MB
    plain = tmp_path / "plain.pt"
    torch.save({"x": torch.ones(4)}, plain)
    bomb = tmp_path / "checkpoints" / "global_step1" / "mp_rank_00_model_states.pt"
    bomb.parent.mkdir(parents=True)
    (tmp_path / "checkpoints" / "latest").write_text("global_step1")
    with zipfile.ZipFile(plain) as zin, zipfile.ZipFile(bomb, "w") as zout:
        for info in zin.infolist():  # stored, as torch.save stores: only the pickle's size gives it away
            data = b"\x80\x02]" + b"]a" * 600_000 + b"." if info.filename.endswith("data.pkl") else zin.read(info)
            zout.writestr(info.filename, data)
    started = time.time()
    assert "holds 1,200,004 bytes, more than torch.save writes" in torch_files.zip_problem(bomb).text
    with pytest.raises(UnsafeCheckpointError, match="more than torch.save writes for a model's or an optimizer's state"):
        read_checkpoint_file(bomb)
    with pytest.raises(UnsafeCheckpointError, match="data.pkl' holds 1,200,004 bytes"):
        check_resume(tmp_path / "checkpoints")
    with pytest.raises(ElsaError, match="pytorch_model.bin is no file torch.save wrote"):
        check_weight_files(_folder_with(tmp_path / "model", bomb, "pytorch_model.bin"), "model x")
    assert time.time() - started < 10
    torch.save({"x": torch.ones(4)}, bomb, _use_new_zipfile_serialization=False)  # all pickle: no size to check first
    with pytest.raises(UnsafeCheckpointError, match="not in torch.save's zip format"):
        read_checkpoint_file(bomb)
    bomb.write_bytes(b"")  # cut short (a failed write), not altered: a resume falls back past its tag
    with pytest.raises(ValueError, match="cut short"):
        read_checkpoint_file(bomb)


def _legacy_bytes(state: dict) -> bytes:
    out = io.BytesIO()
    torch.save(state, out, _use_new_zipfile_serialization=False)
    return out.getvalue()


def test_a_legacy_torch_file_is_held_to_the_pickle_cap_and_read_whole_where_it_fits(tmp_path, monkeypatch):
    """A walk (2026-12-04): a file in torch's legacy format (no zip: five pickles, then the storages) passed every check,
    so a pickle of empty lists in a model folder's pytorch_model.bin took ~170x its size when transformers or the sparse
    reader unpickled it. Its pickles are now walked opcode by opcode (nothing built) and held to the zip's cap, the
    object's pickle as much as the first; a whole legacy file is still read (the sparse reader mapped it by name and
    failed as "truncated or corrupt"), and a .bin that is no pickle (another tool's weights) is left to its reader."""
    import elsa_ds.sparse.folder as folder_module

    monkeypatch.setattr(torch_files, "MAX_PICKLE_BYTES", 2**20)
    whole = _legacy_bytes({"w": torch.arange(4.0)})
    ends = _pickle_ends(whole)
    bomb = b"\x80\x02]" + b"]a" * 600_000 + b"."  # 1.2 MB of opcodes that build 600,000 lists
    for name, data in [("first", bomb + whole), ("object", whole[:ends[2]] + bomb + whole[ends[3]:])]:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "pytorch_model.bin").write_bytes(data)
        assert "run past 1,048,576 bytes" in torch_files.zip_problem(folder / "pytorch_model.bin").text
        with pytest.raises(ElsaError, match="pytorch_model.bin is no file torch.save wrote.*legacy format"):
            check_weight_files(folder, "model x")
        with pytest.raises(SparseCheckpointError, match="pytorch_model.bin: its pickles .* run past"):
            folder_module.TensorReader(folder).get("w")
        with pytest.raises(UnsafeCheckpointError, match="run past 1,048,576 bytes"):
            read_checkpoint_file(folder / "pytorch_model.bin")
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "pytorch_model.bin").write_bytes(whole)
    assert torch_files.zip_problem(plain / "pytorch_model.bin") is None
    check_weight_files(plain, "model x")
    assert torch.equal(folder_module.TensorReader(plain).get("w"), torch.arange(4.0))
    (plain / "pytorch_model.bin").write_bytes(b"ggjt" + bytes(range(256)) * 8192)  # 2 MB, no pickle: torch refuses it
    assert torch_files.zip_problem(plain / "pytorch_model.bin") is None
    check_weight_files(plain, "model x")


def _pickle_ends(whole: bytes) -> list[int]:
    """Where each of a legacy file's five pickles ends (the byte after its STOP), walked without building anything."""
    import pickletools

    stream, ends = io.BytesIO(whole), []
    for _ in range(torch_files.LEGACY_PICKLES):
        list(pickletools.genops(stream))
        ends.append(stream.tell())
    return ends


def _legacy_parts(state: dict) -> tuple[bytes, bytes, bytes]:
    """A legacy save of ``state`` as (its first four pickles, its list of storage keys, the storages' bytes)."""
    whole = _legacy_bytes(state)
    ends = _pickle_ends(whole)
    return whole[:ends[3]], whole[ends[3]:ends[4]], whole[ends[4]:]


def test_a_legacy_torch_file_must_hold_every_storage_it_declares(tmp_path):
    """The fourth audit (2026-12-05): torch's legacy loader allocates each storage the object's pickle declares and fills
    only those the last pickle lists, so a .bin listing none loaded as tensors of uninitialised memory (an 883-byte file
    became a 268.6 MB sparse checkpoint holding the process's heap; a model evaluated as NaN). Every declared storage
    must be listed once and stored whole where torch reads it; whole legacy files of every dtype still read, and a pickle
    that would run code runs none while its storages are counted."""

    import elsa_ds.sparse.folder as folder_module

    state = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3, dtype=torch.bfloat16), "i": torch.arange(4),
             "m": torch.tensor([True, False]), "h": torch.zeros(2, dtype=torch.float16), "e": torch.empty(0)}
    state["view"] = state["w"][1]  # a second tensor on the first one's storage
    head, keys, data = _legacy_parts(state)
    listed, (first,) = pickle.loads(keys), struct.unpack("<q", data[:8])  # the first listed storage's count of entries
    cases = {"whole": (head + keys + data, None),
             "none listed": (head + pickle.dumps([], protocol=2), "declare 6 storages and list 0 storages to read, 6 of"),
             "one missing": (head + pickle.dumps(listed[1:], protocol=2) + data, "declare 6 storages and list 5 storages to read, 1 of"),
             "listed twice": (head + pickle.dumps(listed + listed[:1], protocol=2) + data, "list a storage to read twice"),
             "cut short": (head + keys + data[:-1], "is not where torch reads it"),
             "bytes after": (head + keys + data + b"\0" * 8, "8 bytes after its last storage"),
             "count altered": (head + keys + struct.pack("<q", first + 1) + data[8:], f"of {first} entries is not where")}
    for name, (content, problem) in cases.items():
        folder = tmp_path / name.replace(" ", "_")
        folder.mkdir()
        (folder / "pytorch_model.bin").write_bytes(content)
        found = torch_files.zip_problem(folder / "pytorch_model.bin")
        if problem is None:
            assert found is None
            check_weight_files(folder, "model x")
            loaded = torch.load(folder / "pytorch_model.bin", weights_only=True)
            assert all(torch.equal(loaded[k], v) for k, v in state.items())
            assert torch.equal(folder_module.TensorReader(folder).get("b"), state["b"])
            continue
        assert found is not None and problem in found.text, (name, found)
        with pytest.raises(ElsaError, match="pytorch_model.bin is no file torch.save wrote"):
            check_weight_files(folder, "model x")
        with pytest.raises(SparseCheckpointError, match="pytorch_model.bin: it"):
            folder_module.TensorReader(folder).get("w")

    marker = tmp_path / "ran"

    class Runs:  # a pickle that would run a command when unpickled by an unpickler that imports what it names
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    runs = tmp_path / "runs.bin"
    stream = io.BytesIO()
    for part in (torch.serialization.MAGIC_NUMBER, torch.serialization.PROTOCOL_VERSION, {"protocol_version": 1001},
                 {"w": Runs()}, []):
        pickle.dump(part, stream, protocol=2)
    runs.write_bytes(stream.getvalue())
    assert torch_files.zip_problem(runs) is None and not marker.exists()  # counted: no storage, nothing run
    with pytest.raises(pickle.UnpicklingError):
        torch.load(runs, weights_only=True)  # the loader that reads it next refuses what it names
    alien = head.replace(b"FloatStorage", b"FloatStorageX")
    (tmp_path / "alien.bin").write_bytes(alien + keys + data)
    assert "FloatStorageX, not a storage class torch.save writes" in torch_files.zip_problem(tmp_path / "alien.bin").text


DEEP_KEY = b"X\x01\x00\x00\x00k" + b"\x85" * 3_000_000  # the string "k" in 3,000,000 one-item tuples (3 MB of TUPLE1)


def test_a_pickle_nesting_deeper_than_torch_save_writes_is_refused_before_anything_unpickles_it(tmp_path):
    """A fifth audit (2026-12-06): CPython hashes a tuple recursively with no depth guard, so a dict keyed by a tuple nested
    3,000,000 deep crashed whatever unpickled it (a segmentation fault: no error line, the output's lock left behind):
    the legacy storage count as elsa-prune checked a model folder, torch's weights-only load on --resume. Each pickle of a
    torch file is now walked for its nesting before anything builds it; what torch.save writes nests ~10 deep."""
    from elsa_ds.files.pickle_walk import MAX_NESTING, walk

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "nested": {"a": [({"b": (torch.ones(2),)},)]}}
    for legacy_format in (False, True):  # a real save reads, and nests shallowly
        path = tmp_path / f"real_{legacy_format}.pt"
        torch.save(state, path, _use_new_zipfile_serialization=not legacy_format)
        assert torch_files.zip_problem(path) is None
    stream = io.BytesIO()
    torch.save(state, stream)
    with zipfile.ZipFile(io.BytesIO(stream.getvalue())) as zf:
        pickled = zf.read(next(n for n in zf.namelist() if n.endswith("/data.pkl")))
    assert 5 <= walk(io.BytesIO(pickled)).depth <= 12
    deep_dict = b"\x80\x02}" + DEEP_KEY + b"K\x01s."  # {((("k",),),...): 1}
    assert walk(io.BytesIO(deep_dict)).depth == MAX_NESTING + 1  # the walk stops there
    crafted = tmp_path / "crafted.pt"  # a real save's zip, its pickle replaced
    with zipfile.ZipFile(io.BytesIO(stream.getvalue())) as src, zipfile.ZipFile(crafted, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            dst.writestr(info, deep_dict if info.filename.endswith("/data.pkl") else src.read(info.filename))
    assert "containers nested more than 1,000 deep" in torch_files.zip_problem(crafted).text
    with pytest.raises(UnsafeCheckpointError, match="containers nested more than 1,000 deep"):
        read_checkpoint_file(crafted)
    raw = crafted.read_bytes()  # as torch's reader takes them, which zipfile does not (a review): each still refused
    crc = struct.pack("<I", zlib.crc32(deep_dict))
    variants = {"its CRC 0 (torch checks none)": raw.replace(crc, b"\0" * 4),
                "named DATA.PKL (miniz finds any case)": raw.replace(b"/data.pkl", b"/DATA.PKL")}
    for what, data in variants.items():
        (tmp_path / "variant.pt").write_bytes(data)
        problem = torch_files.zip_problem(tmp_path / "variant.pt")
        assert problem is not None and "nested more than 1,000 deep" in problem.text, what
    flags = bytearray(stream.getvalue())  # an encrypted flag on every entry of a real save: no exception out of the check
    for at in [m.start() for m in re.finditer(b"PK\x03\x04", flags)] + [m.start() + 2 for m in re.finditer(b"PK\x01\x02", flags)]:
        flags[at + 6] |= 1
    (tmp_path / "flagged.pt").write_bytes(bytes(flags))
    assert torch_files.zip_problem(tmp_path / "flagged.pt") is None
    folder = tmp_path / "model"
    folder.mkdir()
    key = b"(X\x07\x00\x00\x00storagectorch\nFloatStorage\n" + DEEP_KEY + b"X\x03\x00\x00\x00cpuK\x01Nt"
    whole = _legacy_bytes({"w": torch.ones(1)})  # legacy: its first three pickles, then the object's, keyed by the tuple
    (folder / "pytorch_model.bin").write_bytes(whole[:_pickle_ends(whole)[2]] + b"\x80\x02}X\x01\x00\x00\x00w" + key
                                               + b"Qs." + pickle.dumps(["k"], protocol=2) + struct.pack("<q", 1) + b"\0" * 4)
    with pytest.raises(ElsaError, match="pytorch_model.bin is no file torch.save wrote .*nested more than 1,000 deep"):
        check_weight_files(folder, "model x")
    shallow = b"\x80\x02}" + b"X\x01\x00\x00\x00k" + b"\x85" * 900 + b"K\x01s."  # deep, but within the limit: read
    assert walk(io.BytesIO(shallow)).depth == 901


def test_the_walk_counts_a_container_filled_after_it_was_memoized():
    """A list memoized empty, then filled with a deep value and taken from the memo into a tuple: the tuple is as deep as
    what the list became (the memo shares the list's depth), as the unpickler's objects would be."""
    from elsa_ds.files.pickle_walk import walk

    deep = b"X\x01\x00\x00\x00k" + b"\x85" * 50  # 50 nested tuples
    filled_later = b"\x80\x02]q\x00h\x00" + deep + b"a0" + b"h\x00\x85."  # [] memo 0, its copy popped after APPEND; (l,)
    assert walk(io.BytesIO(filled_later)).depth == 52
    # MEMOIZE stores at len(memo), which a PUT past a gap makes differ from the number of stores (a review: the walk took
    # a leaf from the slot the unpickler had just filled with 999 tuples, and counted 1,000 for 3,000,000)
    gap = b"\x80\x04}Nq\x00q\x00q\x020" + b"X\x01\x00\x00\x00k" + (b"Nq\x020\x940h\x02" + b"\x85" * 999) * 3 + b"K\x01s."
    assert walk(io.BytesIO(gap)).depth == 1001  # past MAX_NESTING: the walk stops there (it said 1,000: read)


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")  # torch deprecates them; old files still hold them
@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated:UserWarning")  # torch's own legacy loader of them
def test_the_legacy_storage_count_reads_keys_as_torch_does_and_stays_small(tmp_path):
    """The review of the fourth audit's fix: the counter must tell apart what torch tells apart (a Python 2 str read as
    UTF-8, as torch.load does: read as latin-1, ``b"\\xc3\\xa9"`` and the text ``"Ã©"`` were one key to it and two to torch,
    and an unlisted storage passed), never repr the pickle's data (a shared list 40 deep), never size its memo by a
    number the pickle gives (5 bytes: 2^26 slots), never format an unbounded count; quantized storages are storages."""
    import collections
    import time

    head, keys, data = _legacy_parts({"w": torch.ones(2)})
    three = head[:_pickle_ends(head + keys + data)[2]]  # magic number, protocol, system info

    def legacy(object_pickle: bytes, listed: bytes) -> Path:
        path = tmp_path / f"f{len(list(tmp_path.iterdir()))}.bin"
        path.write_bytes(three + object_pickle + listed + data)
        return path

    class Raw(bytes):  # pickled as a Python 2 str (SHORT_BINSTRING)
        pass

    class Storage:
        def __init__(self, key, n):
            self.pid = ("storage", torch.FloatStorage, key, "cpu", n, None)

    class Tensor:
        def __init__(self, key, n):
            self.storage, self.n = Storage(key, n), n

        def __reduce__(self):
            return (torch._utils._rebuild_tensor_v2, (self.storage, 0, (self.n,), (1,), False, collections.OrderedDict()))

    class Pickler(pickle._Pickler):
        dispatch = dict(pickle._Pickler.dispatch)
        dispatch[Raw] = lambda self, obj: self.write(pickle.SHORT_BINSTRING + bytes([len(obj)]) + bytes(obj))

        def persistent_id(self, obj):
            return obj.pid if isinstance(obj, Storage) else None

    def dumped(obj) -> bytes:
        out = io.BytesIO()
        Pickler(out, 2).dump(obj)
        return out.getvalue()

    mojibake = b"\xc3\xa9".decode("latin1")
    two_keys = legacy(dumped({"w": Tensor(mojibake, 2), "hidden": Tensor(Raw(b"\xc3\xa9"), 4096)}), dumped([mojibake]))
    assert "declare 2 storages and list 1 storage to read, 1 of the declared" in torch_files.zip_problem(two_keys).text
    shared = b"\x80\x02(X\x07\x00\x00\x00storage]q\x000" + b"".join(
        b"(h" + bytes([i]) + b"h" + bytes([i]) + b"lq" + bytes([i + 1]) + b"0" for i in range(40))
    shared += b"h\x28X\x01\x00\x00\x00kX\x03\x00\x00\x00cpuK\x00NtQ."  # the 2^40-long repr as the storage's class
    started = time.time()
    assert "is of a list, not a storage class" in torch_files.zip_problem(legacy(shared, dumped(["k"]))).text
    assert time.time() - started < 5
    memo = legacy(b"\x80\x02]r\x00\x00\x00\x04.", keys)  # an empty list put at memo slot 2^26
    assert "a memo entry numbered ahead" in torch_files.zip_problem(memo).text
    huge = b"\x80\x02(X\x07\x00\x00\x00storagecmodule\nFloatStorage\nX\x01\x00\x00\x00kX\x03\x00\x00\x00cpu"
    huge = huge.replace(b"cmodule\n", b"ctorch\n") + b"\x8b" + struct.pack("<i", 2000) + b"\x01" * 2000 + b"NtQ."
    assert "more entries than the file holds" in torch_files.zip_problem(legacy(huge, dumped(["k"]))).text
    quantized = tmp_path / "quantized.bin"
    state = {"q": torch.quantize_per_tensor(torch.randn(6), 0.1, 3, torch.quint8),
             "c": torch.quantize_per_channel(torch.randn(2, 3), torch.tensor([0.1, 0.2]), torch.tensor([0, 1]), 0, torch.qint8)}
    torch.save(state, quantized, _use_new_zipfile_serialization=False)
    assert torch_files.zip_problem(quantized) is None
    assert torch.equal(torch.load(quantized, weights_only=True)["q"].int_repr(), state["q"].int_repr())


def test_a_tar_in_torch_0_3s_format_is_refused_before_torch_unpickles_its_members(tmp_path):
    import tarfile

    pickled = tmp_path / "pickle"
    pickled.write_bytes(b"\x80\x02]q\x00.")
    folder = tmp_path / "model"
    folder.mkdir()
    with tarfile.open(folder / "pytorch_model.bin", "w:", format=tarfile.PAX_FORMAT) as tar:
        tar.add(pickled, arcname="pickle")
    assert "tar format" in torch_files.zip_problem(folder / "pytorch_model.bin").text
    with pytest.raises(ElsaError, match="pytorch_model.bin is no file torch.save wrote .*tar format"):
        check_weight_files(folder, "model x")


def _compressed_copy(src: Path, dst: Path, pad: int) -> None:
    """``src`` (a torch.save zip) with its pickle stored deflated and ``pad`` zero bytes after it: a small file that
    unpacks to ``pad`` more bytes."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info)
            if info.filename.endswith("data.pkl"):
                zout.writestr(info.filename, data + b"\0" * pad, compress_type=zipfile.ZIP_DEFLATED, compresslevel=1)
            else:
                zout.writestr(info, data)


def test_a_torch_zip_stored_compressed_is_refused_before_anything_unpacks_it(tmp_path):
    plain = tmp_path / "plain.pt"
    torch.save({"x": torch.ones(4)}, plain)
    assert torch_files.zip_problem(plain) is None
    tags = tmp_path / "checkpoints"
    (tags / "global_step1").mkdir(parents=True)
    (tags / "latest").write_text("global_step1")
    bomb = tags / "global_step1" / "mp_rank_00_model_states.pt"
    _compressed_copy(plain, bomb, 64 * 2**20)  # 64 MiB unpacked
    assert bomb.stat().st_size < 2**20  # ~0.3 MB
    assert "stored compressed" in torch_files.zip_problem(bomb).text
    with pytest.raises(UnsafeCheckpointError, match="stored compressed, which torch.save never writes"):
        check_resume(tags)
    with pytest.raises(ElsaError, match="pytorch_model.bin is no file torch.save wrote"):
        check_weight_files(_folder_with(tmp_path / "model", bomb, "pytorch_model.bin"), "model x")
    sparse = _sparse_checkpoint(tmp_path / "s")
    torch.save(_as_bin(sparse), tmp_path / "s.bin")
    _compressed_copy(tmp_path / "s.bin", sparse / "pytorch_model.bin", 64 * 2**20)
    with pytest.raises(SparseCheckpointError, match="stored compressed"):
        verify(sparse)


@pytest.mark.parametrize("shard", ["sub/weights.bin", "weights.pt"])
def test_a_shard_an_index_names_is_checked_whatever_its_name(tmp_path, shard):
    """transformers reads every shard pytorch_model.bin.index.json names with torch.load: one in a subfolder or under
    another suffix was never zip-checked (a 0.3 MB file unpacked 64 MiB; a trust audit, 2026-11-30); one the folder
    lacks, a FIFO there: refused in one line too."""
    plain, model = tmp_path / "plain.pt", tmp_path / "model"
    torch.save({"x": torch.ones(4)}, plain)
    (model / "sub").mkdir(parents=True)
    (model / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {"x": shard}}))
    with pytest.raises(ElsaError, match=f"names {shard}, which the folder lacks"):
        check_weight_files(model, "model x")
    os.mkfifo(model / shard)
    with pytest.raises(ElsaError, match=f"{shard} is not a regular file"):
        check_weight_files(model, "model x")
    (model / shard).unlink()
    shutil.copy(plain, model / shard)
    check_weight_files(model, "model x")
    _compressed_copy(plain, model / shard, 64 * 2**20)
    with pytest.raises(ElsaError, match=f"{shard} is no file torch.save wrote .*stored compressed"):
        check_weight_files(model, "model x")


def test_a_latest_file_longer_than_a_tag_is_refused_without_reading_it(tmp_path):
    (tmp_path / "global_step1").mkdir()
    with (tmp_path / "latest").open("wb") as fh:
        fh.write(b"global_step1")
        fh.truncate(2**30)  # 1 GiB
    with pytest.raises(ElsaError, match="holds more than a tag's name"):
        resume_order(tmp_path)
    (tmp_path / "latest").write_text("global_step1\n")
    assert resume_order(tmp_path) == ["global_step1"]


def test_a_packed_mask_whose_bytes_disagree_with_its_shape_is_refused(tmp_path):
    good = tmp_path / "good.safetensors"
    write_masks(good, {"w": torch.rand(64, 64) < 0.5})
    assert MaskReader(good).shapes == {"w": (64, 64)}
    meta = {"format": "elsa_ds packed keep-masks", "shapes": json.dumps({"w": [4096, 4096]})}
    for name, tensor in (("short", torch.zeros(1, dtype=torch.uint8)), ("float", torch.zeros(4096 * 4096 // 32))):
        save_file({"w": tensor}, str(tmp_path / f"{name}.safetensors"), metadata=meta)
        with pytest.raises(ElsaError, match=r"where a packed mask of shape \[4096, 4096\] is U8 \[2097152\]"):
            MaskReader(tmp_path / f"{name}.safetensors")
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(good.read_bytes()[:-100])
    with pytest.raises(ElsaError, match="cut.safetensors is damaged"):
        check_weight_files(cut, "--init_mask x")
    with pytest.raises(ElsaError, match="not a readable safetensors file"):
        MaskReader(cut)


@pytest.mark.parametrize("field", [{"ppl": {"wiki": {"ppl": "x"}}}, {"sparsity": [1]}, {"sparsity": {"overall": "a"}},
                                   {"tasks": {"arc": {"acc": "high"}}}, {"average_acc": "0.5"}, {"model": 3},
                                   {"sparsity": {"overall": 10**400}}, {"ppl": {"wiki": {"ppl": 5.0, "windows": [64]}}},
                                   {"seqlen": {"n": 128}},  # the last two: a second audit (an unhashable shape, a traceback)
                                   # an eighth audit: figures no run writes, printed in the table without a word
                                   {"sparsity": {"overall": -2.5}}, {"ppl": {"wiki": {"ppl": -3.0}}}, {"average_acc": 57.0},
                                   {"tasks": {"arc": {"acc": 57.0}}}, {"ppl": {"wiki": {"ppl": 5.0, "windows": -10}}},
                                   {"seqlen": -64}, {"protocol": {"limit": "no"}}])
def test_an_evaluation_result_with_a_string_where_a_number_goes_is_refused(tmp_path, field):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"model": "m", "ppl": {"wiki": {"ppl": 5.0}}} | field))
    with pytest.raises(ElsaError, match="which elsa-evaluate never writes"):
        load_result(path)


def test_an_evaluation_result_of_a_nan_model_still_compares(tmp_path):
    """A NaN model's perplexity is written as it is (NaN, or Infinity): the table shows it."""
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"model": "m", "ppl": {"wiki": {"ppl": float("nan")}, "c4": {"ppl": float("inf")}},
                                "sparsity": {"overall": 0.9}, "protocol": {"limit": 4}}))
    assert load_result(path)["ppl"]["c4"]["ppl"] == float("inf")


def test_a_model_folder_whose_side_files_are_too_deep_or_too_large_is_refused_in_one_error(tmp_path):
    from elsa_ds.data.blocks import load_tokenizer
    from elsa_ds.models import load_causal_lm
    from elsa_ds.settings.config import DEMO_MODEL_DIR

    model = tmp_path / "model"
    shutil.copytree(DEMO_MODEL_DIR, model)
    (model / "generation_config.json").write_text('{"a": ' + DEEP + "}")
    with pytest.raises(ElsaError, match="cannot load model"):
        load_causal_lm(str(model), torch.float32)
    (model / "generation_config.json").write_text("{}")
    (model / "tokenizer_config.json").write_text('{"a": ' + DEEP + "}")
    with pytest.raises(ElsaError, match="cannot load the tokenizer"):
        load_tokenizer(str(model))
    with (model / "special_tokens_map.json").open("wb") as fh:
        fh.truncate(json_data.MODEL_FILE_BYTES + 1)  # transformers would read it whole
    with pytest.raises(ElsaError, match="special_tokens_map.json holds 268,435,457 bytes"):
        check_weight_files(model, "model x")


def _rewritten(plain: Path, out: Path, pad: int, extra: bytes = b"") -> bytes:
    """``plain`` with its pickle deflated and padded by ``pad`` zeros, its entry given ``extra`` as its extra field."""
    with zipfile.ZipFile(plain) as zin, zipfile.ZipFile(out, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info)
            if info.filename.endswith("data.pkl"):
                entry = zipfile.ZipInfo(info.filename)
                entry.compress_type, entry.extra = zipfile.ZIP_DEFLATED, extra
                zout.writestr(entry, data + b"\0" * pad, compresslevel=1)
            else:
                zout.writestr(info, data)
    return out.read_bytes()


def _with_decoy_directory(raw: bytes) -> bytes:
    """A second central directory, every entry marked stored, put just before the end record: Python's zipfile reads
    it (taking the gap for data in front of the zip); torch's reader goes by the end record's offset to the real one."""
    end = raw.rfind(b"PK\x05\x06")
    size_cd, offset_cd = struct.unpack_from("<II", raw, end + 12)
    decoy, p = bytearray(raw[offset_cd:offset_cd + size_cd]), 0
    while p < len(decoy):
        names, extras, comments = struct.unpack_from("<HHH", decoy, p + 28)
        struct.pack_into("<H", decoy, p + 10, 0)  # stored
        struct.pack_into("<I", decoy, p + 24, struct.unpack_from("<I", decoy, p + 20)[0])  # its size as stored
        p += 46 + names + extras + comments
    return raw[:end] + bytes(decoy) + raw[end:]


DECOY = "in front of its first zip entry|does not end where its end records start"


def test_a_zip_that_python_and_torch_read_differently_never_reaches_torch(tmp_path):
    """Found by a review: zipfile refuses an extra field that torch's reader ignores, and reads a decoy directory that
    torch's does not; either let a compressed pickle through a check that trusted zipfile's reading."""
    plain = tmp_path / "plain.pt"
    torch.save({"x": torch.ones(4)}, plain)
    odd_extra = tmp_path / "extra.pt"
    _rewritten(plain, odd_extra, 8 * 2**20, extra=b"\x99\x99\xff\x00")  # claims 255 bytes where none follow
    decoy = tmp_path / "decoy.pt"
    decoy.write_bytes(_with_decoy_directory(_rewritten(plain, tmp_path / "deflated.pt", 8 * 2**20)))
    assert not torch_files.zip_problem(odd_extra).altered  # unreadable to zipfile: as a cut file is, torch never reads it
    assert re.search(DECOY, torch_files.zip_problem(decoy).text)
    with pytest.raises(ValueError, match="zip directory is unreadable"):
        read_checkpoint_file(odd_extra)  # load_latest then falls back to the previous tag
    with pytest.raises(UnsafeCheckpointError, match=DECOY):
        read_checkpoint_file(decoy)
    for path, refusal in ((odd_extra, "is readable"), (decoy, DECOY)):
        tags = tmp_path / path.stem
        (tags / "global_step1").mkdir(parents=True)
        (tags / "latest").write_text("global_step1")
        shutil.copy(path, tags / "global_step1" / "mp_rank_00_model_states.pt")
        with pytest.raises(ElsaError, match=refusal):
            check_resume(tags)


def test_sparse_and_meta_tensors_are_refused(tmp_path):
    path = tmp_path / "state.pt"
    for tensor, kind in ((torch.sparse_coo_tensor(torch.zeros(2, 1, dtype=torch.long), torch.ones(1), (2**20, 2**20)),
                          "sparse_coo"), (torch.empty(2**20, 2**20, device="meta"), "meta")):
        torch.save({"w": tensor}, path)
        with pytest.raises(UnsafeCheckpointError, match=f"w is a (torch.)?{kind} tensor"):
            read_checkpoint_file(path)


def test_odd_entries_of_a_model_folder_neither_crash_nor_hang_its_check(tmp_path):
    import os
    import signal

    model = tmp_path / "model"
    model.mkdir()
    (model / "training_args.bin").mkdir()  # a folder with a weight file's name
    (model / "gone.json").symlink_to(model / "missing.json")  # a link inside the folder, to nothing
    os.mkfifo(model / "pipe.bin")  # opening it would wait for a writer
    signal.signal(signal.SIGALRM, lambda *_: pytest.fail("check_weight_files hung on a FIFO"))
    signal.alarm(20)
    try:
        assert check_weight_files(model, "model x") is None
    finally:
        signal.alarm(0)


def test_a_zip_directory_larger_than_any_torch_save_writes_is_refused_before_it_is_read(tmp_path):
    """zipfile holds ~0.6 KiB for each directory entry it reads (5x a file of empty entries, and seconds per 100,000):
    the end records' counts are read first, zipfile's and torch's (miniz) alike, the zip64 record torch always writes
    included. A real zip of MAX + 1 entries, and a torch.save file whose zip64 record alone claims a huge directory."""
    plain = tmp_path / "plain.pt"
    torch.save({"x": torch.ones(4)}, plain)
    assert torch_files.zip_problem(plain) is None
    many = tmp_path / "many.pt"
    with zipfile.ZipFile(many, "w") as zf:
        for i in range(torch_files.MAX_ZIP_ENTRIES + 1):
            zf.writestr(f"many/data/{i}", b"")
    with pytest.raises(UnsafeCheckpointError, match=f"declares {torch_files.MAX_ZIP_ENTRIES + 1:,} entries"):
        read_checkpoint_file(many)
    raw = bytearray(plain.read_bytes())
    zip64 = len(raw) - 22 - 20 - 56  # torch writes the zip64 end record, its locator and the classic record last
    assert raw[zip64:zip64 + 4] == torch_files.ZIP64_END_RECORD
    struct.pack_into("<Q", raw, zip64 + 40, 2**40)  # the directory's size in the zip64 record only
    claims = tmp_path / "claims.pt"
    claims.write_bytes(bytes(raw))
    problem = torch_files.zip_problem(claims)
    assert problem is not None and problem.altered and f"{2**40:,} bytes" in problem.text
    with pytest.raises(ElsaError, match="pytorch_model.bin is no file torch.save wrote"):
        check_weight_files(_folder_with(tmp_path / "model", claims, "pytorch_model.bin"), "model x")


def _crafted_directory(path: Path, n: int, layout: str) -> None:
    """A zip of one local entry and ``n`` central-directory entries (46 bytes + a 1-byte name each), whose end records
    tell the readers so in three ways a review found a first version of the check missed: the classic record's count
    says 1 (zipfile reads the declared bytes whatever the count); the record 65,558 bytes from the end, behind a comment
    (the edge of zipfile's search); a small classic record whose zip64 locator and record, just before a 64 KiB
    comment's search window, declare the directory (zipfile and miniz seek them in the file)."""
    local = struct.pack("<4s5H3I2H", b"PK\x03\x04", 20, 0, 0, 0, 0, 0, 0, 0, 1, 0) + b"a"
    directory = (struct.pack("<4s6H3I5H2I", b"PK\x01\x02", 20, 20, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0) + b"a") * n
    head, size, at = local + directory, len(directory), len(local)
    if layout == "count says 1":
        tail = struct.pack("<4s4H2IH", b"PK\x05\x06", 0, 0, 1, 1, size, at, 0)
    elif layout == "at the window's edge":
        tail = struct.pack("<4s4H2IH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, size, at, 0xFFFF) + b"\0" * 0x10000
    else:
        zip64 = struct.pack("<4sQ2H2I4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, n, n, size, at)
        locator = struct.pack("<4sIQI", b"PK\x06\x07", 0, len(head), 1)
        tail = zip64 + locator + struct.pack("<4s4H2IH", b"PK\x05\x06", 0, 0, 1, 1, 46, at, 0xFFFF) + b"\0" * 65518
    path.write_bytes(head + tail)


@pytest.mark.parametrize("layout", ["count says 1", "at the window's edge", "zip64 before the comment"])
def test_a_directory_declared_where_only_one_reader_looks_is_refused_too(tmp_path, layout):
    crafted = tmp_path / "crafted.pt"
    n = torch_files.MAX_ZIP_DIRECTORY // 47 + 1  # one entry's bytes past the cap
    _crafted_directory(crafted, n, layout)
    with zipfile.ZipFile(crafted) as zf:
        assert len(zf.infolist()) == n  # what zipfile would read, were it let
    problem = torch_files.zip_problem(crafted)  # a record that does not end the file: torch.save writes none
    assert problem is not None and ("declares" if layout == "count says 1" else "does not end with a zip end") in problem.text


def _split_zip(path: Path, layout: str) -> None:
    """A torch.save zip rebuilt with its pickle deflated (64 MiB unpacked), whose real directory only miniz reads while
    zipfile reads a decoy of one stored, empty entry (a second review's two finds): the real directory after the end
    record, inside its comment, where the record's offset points (zipfile reads the bytes before the record); or two
    zip64 records, the locator pointing at the real one (zipfile reads the one just before the locator)."""
    plain = io.BytesIO()
    torch.save({"x": torch.ones(4)}, plain)
    body = central = b""
    with zipfile.ZipFile(plain) as zf:
        for info in zf.infolist():
            raw, name = zf.read(info), info.filename.encode()
            method = 8 if info.filename.endswith("data.pkl") else 0
            raw += b"\0" * 2**26 if method else b""
            packed = zlib.compress(raw, 9)[2:-4] if method else raw  # raw deflate
            head = (method, 0, 0, zlib.crc32(raw), len(packed), len(raw), len(name))
            central += struct.pack("<4s6H3I5H2I", b"PK\x01\x02", 20, 20, 0, *head, 0, 0, 0, 0, 0, len(body)) + name
            body += struct.pack("<4s5H3I2H", b"PK\x03\x04", 20, 0, *head, 0) + name + packed
    n, name = len(zf.infolist()), b"archive/decoy"
    if layout == "after the end record":
        size = len(central)
        decoy = struct.pack("<4s6H3I5H2I", b"PK\x01\x02", 20, 20, 0, 0, 0, 0, 0, 0, 0, len(name), 0, size - 46 - len(name),
                            0, 0, 0, size + 22) + name  # seen at offset 0 once zipfile shifts it by its negative "concat"
        decoy += b"\0" * (size - len(decoy))
        end = struct.pack("<4s4H2IH", b"PK\x05\x06", 0, 0, n, n, size, len(body) + size + 22, size)
        path.write_bytes(body + decoy + end + central)
        return
    decoy = struct.pack("<4s6H3I5H2I", b"PK\x01\x02", 20, 20, 0, 0, 0, 0, 0, 0, 0, len(name), 0, 0, 0, 0, 0, 0) + name
    real_at, decoy_at = len(body) + len(central), len(body) + len(central) + 56
    real = struct.pack("<4sQ2H2I4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, n, n, len(central), len(body))
    shown = struct.pack("<4sQ2H2I4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, 1, 1, len(decoy), decoy_at)
    locator = struct.pack("<4sIQI", b"PK\x06\x07", 0, real_at, 1)
    end = struct.pack("<4s4H2IH", b"PK\x05\x06", 0, 0, 1, 1, len(decoy), decoy_at, 0)
    path.write_bytes(body + central + real + decoy + shown + locator + end)


@pytest.mark.parametrize("layout", ["after the end record", "two zip64 records"])
def test_a_directory_only_torch_reads_never_reaches_torch(tmp_path, layout):
    split = tmp_path / "split.pt"
    _split_zip(split, layout)
    assert split.stat().st_size < 2**20
    with zipfile.ZipFile(split) as zf:
        assert [(i.filename, i.compress_type) for i in zf.infolist()] == [("archive/decoy", zipfile.ZIP_STORED)]
    assert "data.pkl" in torch._C.PyTorchFileReader(open(split, "rb")).get_all_records()  # torch's view: the deflated pickle
    with pytest.raises((UnsafeCheckpointError, ValueError), match="does not end with a zip end record|does not point at"):
        read_checkpoint_file(split)


def test_a_bin_index_beside_a_safetensors_one_may_name_shards_not_downloaded(tmp_path):
    """Both indexes and only the safetensors shards (a download with --exclude "*.bin"): transformers reads the
    safetensors, so the .bin index's missing shards are no reason to refuse (a review's find, 2026-11-30)."""
    model = tmp_path / "model"
    model.mkdir()
    save_file({"x": torch.ones(4)}, str(model / "model-00001-of-00001.safetensors"))
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "model-00001-of-00001.safetensors"}}))
    (model / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {"x": "pytorch_model-00001-of-00001.bin"}}))
    check_weight_files(model, "model x")
    (model / "model-00001-of-00001.safetensors").unlink()
    with pytest.raises(ElsaError, match="names model-00001-of-00001.safetensors, which the folder lacks"):
        check_weight_files(model, "model x")
