"""Files and arguments from elsewhere stay data (issue 42): a symbolic link at an output's lock path is refused, never
written through; the SLURM launcher hands its arguments on without a shell re-reading them and removes its hostfile
however it ends; a recipe or the DeepSpeed JSON's "elsa" block cannot name a folder whose Python lm-eval would import;
a model folder's own Python (auto_map) never runs, even where transformers would ask and stdin says yes."""
from __future__ import annotations

import json
import re
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elsa_ds.cli import main_evaluate, prune_parser, settings_from_args
from elsa_ds.errors import ElsaError
from elsa_ds.files.ownership import acquire, lock_path, owned, release
from tests.conftest import ROOT, derived_config


def _error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("elsa_ds: error")]


# ---- finding 2: the lock never writes through a link or into a file it did not create --------------------------------
def test_a_symlink_at_the_lock_path_is_refused_and_its_target_kept(tmp_path, capsys):
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"someone's precious bytes\n")
    result = tmp_path / "result.json"
    lock_path(result).symlink_to(victim)
    code = main_evaluate(["--model", str(tmp_path / "no_model"), "--ppl", "wikitext2", "--output", str(result)])
    errors = _error_lines(capsys.readouterr().err)
    assert victim.read_bytes() == b"someone's precious bytes\n"
    assert code == 2 and len(errors) == 1, errors
    assert "is a symbolic link" in errors[0] and str(lock_path(result)) in errors[0]
    assert lock_path(result).is_symlink() and not result.exists()


def test_a_dangling_link_is_not_created_through_and_a_stale_hard_link_is_replaced_not_written(tmp_path):
    out = tmp_path / "out"
    lock_path(out).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ElsaError, match="is a symbolic link") as err:
        acquire(out, "--output_dir")
    assert "\n" not in str(err.value) and not (tmp_path / "elsewhere").exists()
    lock_path(out).unlink()
    victim = tmp_path / "victim.txt"
    victim.write_text("not a lock")
    os.link(victim, lock_path(out))                        # a lock file that names no live holder: stale, taken over
    fd = acquire(out, "--output_dir")
    try:
        assert json.loads(lock_path(out).read_text())["pid"] == os.getpid() and victim.read_text() == "not a lock"
        with pytest.raises(ElsaError, match="being written by another job"):
            with owned(out, "--output_dir"):
                pass
    finally:
        release(out, fd)
    assert not lock_path(out).exists() and victim.read_text() == "not a lock"


# ---- finding 3: launch/slurm_prune.sbatch passes its arguments as they are ----------------------------------------------
STUB_DEEPSPEED = """#!{python}
import json, os, sys, time
args = sys.argv[1:]
hostfile = args[args.index("--hostfile") + 1]
record = {{"argv": args, "hostfile": open(hostfile).read(), "cwd": os.getcwd()}}
with open(os.environ["STUB_RECORD"] + ".tmp", "w") as f:
    json.dump(record, f)
os.replace(os.environ["STUB_RECORD"] + ".tmp", os.environ["STUB_RECORD"])
time.sleep(float(os.environ.get("STUB_SLEEP", "0")))
sys.exit(int(os.environ.get("STUB_RC", "0")))
"""
STUB_SRUN = """#!/usr/bin/env bash
while [[ $1 == -* ]]; do shift; done   # srun's own options; the rest is the command it runs on every node
SLURM_NODEID=0 exec "$@"
"""
STUB_SCONTROL = """#!/usr/bin/env bash
[[ $1 == show && $2 == hostnames ]] && printf 'node-a\\nnode-b\\n'
"""


@pytest.fixture
def slurm(tmp_path):
    """A submit directory and stub srun / scontrol / deepspeed on PATH; the deepspeed stub records what it was given."""
    if shutil.which("bash") is None:
        pytest.skip("needs bash")
    stubs, work = tmp_path / "bin", tmp_path / "submit"
    stubs.mkdir()
    work.mkdir()
    (work / "launch").mkdir()
    (work / "launch" / "prune.py").write_text("")  # submitted from a checkout's root
    for name, text in (("deepspeed", STUB_DEEPSPEED.format(python=sys.executable)), ("srun", STUB_SRUN), ("scontrol", STUB_SCONTROL)):
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}", "SLURM_SUBMIT_DIR": str(work),
           "SLURM_JOB_NODELIST": "node-[a-b]", "SLURM_GPUS_PER_NODE": "4", "STUB_RECORD": str(tmp_path / "record.json")}
    return work, env, tmp_path / "record.json"


ARGS = ["--output_dir", "/shared/out/with space", "--model", "m$(touch PWNED)", "--tag", "`touch PWNED2`;touch PWNED3"]


def _sbatch(work: Path, env: dict[str, str], **kw) -> subprocess.Popen:
    return subprocess.Popen(["bash", str(ROOT / "launch" / "slurm_prune.sbatch"), *ARGS], cwd=work, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def test_slurm_launcher_passes_arguments_unparsed_and_removes_its_hostfile(slurm):
    work, env, record = slurm
    proc = _sbatch(work, env)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    seen = json.loads(record.read_text())
    assert seen["argv"][seen["argv"].index("launch/prune.py") + 1:] == ARGS      # one entry each, space and $(...) kept as text
    assert seen["argv"][seen["argv"].index("--node_rank") + 1] == "0" and seen["hostfile"] == "node-a slots=4\nnode-b slots=4\n"
    assert seen["argv"][seen["argv"].index("--master_addr") + 1] == "node-a"
    assert not list(work.parent.rglob("PWNED*")) and Path(seen["cwd"]) == work
    assert not list(work.glob("hostfile.*"))

    env["SLURM_GPUS_PER_NODE"] = "h100:4"                  # --gpus-per-node=h100:4: the hostfile takes the count
    assert _sbatch(work, env).wait(timeout=60) == 0 and "node-a slots=4\nnode-b slots=4\n" == json.loads(record.read_text())["hostfile"]
    env["SLURM_GPUS_PER_NODE"] = "4"

    env["STUB_RC"] = "3"                                   # a failed job removes it too, and its exit code comes through
    proc = _sbatch(work, env)
    proc.communicate(timeout=60)
    assert proc.returncode == 3 and not list(work.glob("hostfile.*"))

    env["STUB_RC"], env["STUB_SLEEP"] = "0", "60"            # scancel: SIGTERM to the job's processes
    record.unlink()
    proc = _sbatch(work, env, start_new_session=True)
    deadline = time.monotonic() + 30
    while not record.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list(work.glob("hostfile.*")), "the job should be running with its hostfile"
    os.killpg(proc.pid, signal.SIGTERM)
    proc.communicate(timeout=30)
    assert proc.returncode != 0 and not list(work.glob("hostfile.*"))


def test_slurm_launcher_submitted_outside_a_checkout_says_where_to_submit_from(slurm):
    work, env, record = slurm
    shutil.rmtree(work / "launch")
    proc = _sbatch(work, env)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and err.startswith(f"elsa_ds: error: {work} has no launch/prune.py: submit from the root")
    assert not record.exists() and not list(work.glob("hostfile.*"))


def test_slurm_launcher_outside_slurm_and_its_cpus_reach_srun(slurm, tmp_path):
    """A walk: run outside SLURM the script died on "SLURM_JOB_NODELIST: unbound variable" (or scontrol's absence, 127);
    it now says where it runs, exit 2. Slurm 22.05-23.02's srun does not take --cpus-per-task from the job."""
    work, env, record = slurm
    outside = {k: v for k, v in env.items() if k != "SLURM_JOB_NODELIST"}
    proc = _sbatch(work, outside)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and err.startswith("elsa_ds: error: launch/slurm_prune.sbatch runs under SLURM"), err
    assert not record.exists() and not list(work.glob("hostfile.*"))
    srun = tmp_path / "bin" / "srun"
    srun.write_text('#!/usr/bin/env bash\necho "$SRUN_CPUS_PER_TASK" > "$STUB_RECORD.cpus"\n' + STUB_SRUN.split("\n", 1)[1])
    assert _sbatch(work, {**env, "SLURM_CPUS_PER_TASK": "32"}).wait(timeout=60) == 0
    assert Path(str(record) + ".cpus").read_text().strip() == "32"
    assert "#SBATCH --requeue" in (ROOT / "launch" / "slurm_prune.sbatch").read_text()


def test_multinode_launcher_checks_its_hostfile_and_script_first(slurm, tmp_path):
    """A walk: no arguments gave bash's ":?" line (exit 1), a missing hostfile awk's error, a line without slots= or an
    empty hostfile DeepSpeed's traceback; each is one elsa_ds line now, exit 2, before the launcher runs."""
    work, env, record = slurm
    script = ROOT / "launch" / "multinode.sh"
    hostfile = tmp_path / "hosts"

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(script), *args], cwd=work, env=env, capture_output=True, text=True, timeout=60)

    for args, text, needle in ((("x",), None, "usage: launch/multinode.sh HOSTFILE SCRIPT"),
                               ((str(tmp_path / "none"), "launch/prune.py"), None, "no such readable file"),
                               ((str(hostfile), "launch/nope.py"), "node-a slots=8\n", "launch/nope.py: no such script"),
                               ((str(hostfile), "launch/prune.py"), "# nodes\nnode-a slots=8\nnode-b 8\n", "line 3: node-b 8"),
                               ((str(hostfile), "launch/prune.py"), "# nothing\n\n", "names no node")):
        if text is not None:
            hostfile.write_text(text)
        proc = run(*args)
        assert proc.returncode == 2 and proc.stderr.startswith("elsa_ds: error: launch/multinode.sh: ") and needle in proc.stderr, proc.stderr
    # a seventh audit: DeepSpeed's pdsh launcher sends each node one line a shell reads again (--model 'm$(touch X)'
    # ran touch there; "it's" broke the line; pdsh replaces %h): each such argument is refused, in one line
    hostfile.write_text("node-a slots=8\n")
    for odd in ("m$(touch X)", "it's", "a;b", "x`id`", "o/%h", "a\nb", "", "*"):
        proc = run(str(hostfile), "launch/prune.py", "--output_dir", "o", "--model", odd)
        assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1 and "read again" in proc.stderr, (odd, proc.stderr)
    assert not record.exists()
    for plain in ("arc_easy,hellaswag", "0.9", "key=value", "/x/a+b@c:d", "é"):  # a review: what users pass goes through
        assert run(str(hostfile), "launch/prune.py", "--eval_tasks", plain).returncode == 0, plain
        assert json.loads(record.read_text())["argv"][-1] == plain
    hostfile.write_text("# the nodes\nnode-a slots=8\nnode-b slots=8\n")
    assert run(str(hostfile), "launch/prune.py", "--output_dir", "o u t").returncode == 0
    seen = json.loads(record.read_text())["argv"]
    assert seen[seen.index("--master_addr") + 1] == "node-a" and seen[-3:] == ["launch/prune.py", "--output_dir", "o u t"]
    # an audit (2026-12-06): MASTER_ADDR and MASTER_PORT from the environment go into the same line, unchecked
    record.unlink()
    for name, value, needle in (("MASTER_ADDR", "node1;touch X", "read again"), ("MASTER_ADDR", "10.0.0.1 10.0.0.2", "several"),
                                ("MASTER_PORT", "99999", "not a TCP port"), ("MASTER_PORT", "29500 --x", "not a TCP port")):
        proc = subprocess.run(["bash", str(script), str(hostfile), "launch/prune.py"], cwd=work, env={**env, name: value},
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1 and needle in proc.stderr, (value, proc.stderr)
    assert not record.exists()


# ---- finding 4: no code path from a recipe or the DeepSpeed JSON --------------------------------------------------------
def _recipe(tmp_path: Path, settings: dict) -> Path:
    path = tmp_path / "downloaded-recipe.json"
    path.write_text(json.dumps({"source": "somewhere on the internet", "settings": settings}))
    return path


def _prune_args(tmp_path: Path, *extra: str) -> list[str]:
    return ["--deepspeed", "zero3", "--output_dir", str(tmp_path / "out"), *extra]


def test_a_recipe_or_the_json_cannot_name_an_lm_eval_include_path(tmp_path, capsys):
    from elsa_ds.cli import main_prune

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    recipe = _recipe(tmp_path, {"eval_tasks": "my_task", "eval_include_path": str(tasks)})
    with pytest.raises(ElsaError, match="eval_include_path") as err:
        settings_from_args(prune_parser().parse_args(_prune_args(tmp_path, "--recipe", str(recipe))))
    assert str(recipe) in str(err.value) and "command line only" in str(err.value) and "\n" not in str(err.value)
    assert main_prune(_prune_args(tmp_path, "--recipe", str(recipe))) == 2
    errors = _error_lines(capsys.readouterr().err)
    assert len(errors) == 1 and "eval_include_path" in errors[0], errors

    ds_json = derived_config(tmp_path, "zero3.json", elsa={"eval_include_path": str(tasks)})
    with pytest.raises(ElsaError, match=re.escape(f'the "elsa" block of {ds_json}') + '.*eval_include_path'):
        settings_from_args(prune_parser().parse_args(["--deepspeed", str(ds_json), "--output_dir", str(tmp_path / "out")]))

    # task names alone stay allowed in a recipe (looked up among lm-eval's installed tasks); the folder comes from the flag
    names_only = _recipe(tmp_path, {"eval_tasks": "boolq,rte"})
    args = prune_parser().parse_args(_prune_args(tmp_path, "--recipe", str(names_only), "--eval_include_path", str(tasks)))
    _, cfg, _ = settings_from_args(args)
    assert cfg.eval_tasks == ["boolq", "rte"] and cfg.eval_include_path == str(tasks)


# ---- a model folder's own Python never runs, even where transformers would ask and stdin answers yes ------------------
_CODE_RUNNER = """
import sys, torch
from elsa_ds.errors import ElsaError
from elsa_ds.models import load_causal_lm, load_config, meta_model
from elsa_ds.sparse import from_pretrained
known, unknown = sys.argv[1:3]
calls = {"meta_model": lambda: meta_model(load_config(known)),
         "random_init": lambda: load_causal_lm(known, torch.float32, random_init=True),
         "from_pretrained": lambda: load_causal_lm(known, torch.float32),
         "sparse": lambda: from_pretrained(unknown)}
for name, call in calls.items():
    try:
        call()
        print(name, "loaded")
    except ElsaError as err:
        print(name, "refused", type(err).__name__)
"""


def _code_folder(folder: Path, marker: Path, config: dict) -> Path:
    """A model folder whose config.json names Python of its own (auto_map) that, imported, writes ``marker``."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "modeling_evil.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
                                             "class EvilForCausalLM:\n    pass\nclass EvilConfig:\n    pass\n")
    return folder


def test_a_model_folders_own_code_never_runs_even_when_stdin_answers_yes(tmp_path):
    """A model_type transformers ships (ViT) whose auto_map names a causal LM of its own passes config_json's check, and
    transformers then asks on stdin whether to run that code (trust_remote_code unset); a sparse checkpoint's config is
    read with no check at all. Every load passes trust_remote_code=False: refused, nothing of the folder imported."""
    from elsa_ds.sparse.meta import CONFIG_KEY, block, seal

    marker = tmp_path / "ran"
    auto_map = {"AutoConfig": "modeling_evil.EvilConfig", "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    known = _code_folder(tmp_path / "known", marker, {
        "model_type": "vit", "architectures": ["EvilForCausalLM"], "auto_map": auto_map, "hidden_size": 8,
        "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 16})
    (known / "model.safetensors").write_bytes(b"")  # never reached: the config's own class is refused first
    unknown = _code_folder(tmp_path / "unknown", marker, seal({"model_type": "evil", "architectures": ["EvilForCausalLM"],
                                                               "auto_map": auto_map, CONFIG_KEY: block(0.5, {}, {})}))
    proc = subprocess.run([sys.executable, "-c", _CODE_RUNNER, str(known), str(unknown)], input="y\n" * 8, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert not marker.exists(), proc.stdout + proc.stderr[-3000:]
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    for name in ("meta_model", "random_init", "from_pretrained", "sparse"):
        assert any(line.startswith(f"{name} refused") for line in lines), proc.stdout + proc.stderr[-3000:]


def test_an_atomic_write_never_writes_through_a_link_at_its_temporary_name(tmp_path):
    """A folder copied from elsewhere (a checkpoint folder a resume writes its fingerprint into) may hold a link where
    write_atomic puts its temporary file: the link goes, its target stays as it was, the file is written whole."""
    from elsa_ds.files.io import write_json

    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    folder = tmp_path / "copied"
    folder.mkdir()
    (folder / f".elsa_fingerprint.json.{os.getpid()}.tmp").symlink_to(victim)
    write_json(folder / "elsa_fingerprint.json", {"steps": 4})
    assert victim.read_text() == "keep me" and json.loads((folder / "elsa_fingerprint.json").read_text()) == {"steps": 4}
    assert [p.name for p in folder.iterdir()] == ["elsa_fingerprint.json"]


# ---- an audit's finds (2026-11-29): a DeepSpeed JSON naming code, a pickled .bin, a mask file's metadata ----------------
def test_a_deepspeed_json_that_names_modules_to_import_is_refused(tmp_path, capsys):
    """DeepSpeed imports every name in torch_autocast.lower_precision_safe_modules (runtime/torch_autocast.py): a config
    file would run code. Refused when the file is read, before any work; the module is never imported."""
    from elsa_ds.cli import main_prune

    (tmp_path / "evil_module.py").write_text(f"import pathlib\npathlib.Path({str(tmp_path / 'ran')!r}).write_text('ran')\n")
    ds_json = derived_config(tmp_path, "zero3.json", torch_autocast={
        "enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": ["evil_module.Anything"]})
    sys.path.insert(0, str(tmp_path))
    try:
        assert main_prune(["--deepspeed", str(ds_json), "--output_dir", str(tmp_path / "out")]) == 2
    finally:
        sys.path.remove(str(tmp_path))
    errors = _error_lines(capsys.readouterr().err)
    assert len(errors) == 1 and "torch_autocast.lower_precision_safe_modules" in errors[0], errors
    assert not (tmp_path / "ran").exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["../../escaped", "/tmp/elsa_abs_monitor", "..", "logs/run", 7])
def test_a_monitor_job_name_that_leaves_its_folder_is_refused(tmp_path, capsys, name):
    """DeepSpeed's CSV and TensorBoard monitors write in os.path.join(output_path, job_name): a config file's job_name
    with a separator or ".." (or an absolute one, which join takes whole) would put logs outside the folder. Refused
    when the file is read, one line, before any work; a plain name is accepted."""
    from elsa_ds.cli import main_prune
    from elsa_ds.zero.ds_config import DsConfig

    ds_json = derived_config(tmp_path, "zero3.json", csv_monitor={"enabled": True, "output_path": str(tmp_path / "logs"),
                                                                 "job_name": name})
    assert main_prune(["--deepspeed", str(ds_json), "--output_dir", str(tmp_path / "out")]) == 2
    errors = _error_lines(capsys.readouterr().err)
    assert len(errors) == 1 and "csv_monitor.job_name" in errors[0], errors
    assert not (tmp_path / "out").exists() and not (tmp_path / "logs").exists()
    plain = derived_config(tmp_path, "zero3.json", tensorboard={"enabled": True, "job_name": "run-1.a"})
    assert DsConfig.load(plain).raw["tensorboard"]["job_name"] == "run-1.a"


def test_a_pickled_bin_model_or_a_damaged_mask_file_is_one_line(tmp_path, tiny_model_dir):
    """A .bin weights file with a pickle beyond tensors: torch's weights-only load refuses it and the load says so (it
    was a traceback); a packed mask file whose shapes metadata is not JSON: one line naming it."""
    import torch
    from safetensors.torch import load_file, save_file

    from elsa_ds.files.mask_file import MaskReader
    from elsa_ds.models import load_causal_lm

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    state = load_file(model / "model.safetensors")
    (model / "model.safetensors").unlink()
    state["payload"] = _Runs(tmp_path / "ran")
    torch.save(state, model / "pytorch_model.bin")
    with pytest.raises(ElsaError, match="holds objects beyond tensors") as refused:
        load_causal_lm(str(model), torch.float32)
    assert "\n" not in str(refused.value) and not (tmp_path / "ran").exists()
    masks = tmp_path / "mask.safetensors"
    save_file({"w": torch.zeros(1, dtype=torch.uint8)}, str(masks), metadata={"shapes": "{not json"})
    with pytest.raises(ElsaError, match="not JSON") as refused:
        MaskReader(masks)
    assert str(masks) in str(refused.value)


class _Runs:
    """Unpickled, it writes ``path`` (the payload a crafted weights file would carry)."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (Path.write_text, (self.path, "ran"))


# ---- a write-side audit's finds (2026-11-30): links and hard links where a job writes ----------------------------------
def test_a_link_where_the_job_keeps_a_side_file_is_refused_before_any_work(tmp_path):
    """A fresh run (neither --resume nor --overwrite) looked nowhere before writing its side files beside the output: a
    link at `.NAME.best_projection` had its snapshot written into the link's target. Refused in one line now."""
    from elsa_ds.cli import main_prune
    from tests.inprocess import run_main

    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "rank0.pt").write_text("the user's")
    (tmp_path / ".out.best_projection").symlink_to(victim)
    code, err, _ = run_main(main_prune, ["--deepspeed", "zero3_offload", "--dataset", "shakespeare", "--seqlen", "64",
                                         "--steps", "4", "--interval", "2", "--val_windows", "2", "--baseline", "none",
                                         "--init_mask", "none", "--select_every", "1", "--output_dir", str(tmp_path / "out")])
    lines = _error_lines(err)
    assert code == 2 and len(lines) == 1 and ".out.best_projection beside it is a symbolic link" in lines[0], err[-2000:]
    assert (victim / "rank0.pt").read_text() == "the user's" and not (tmp_path / "out").exists()


def test_a_resumed_folders_hard_linked_files_get_copies_of_their_own(tmp_path):
    """`cp -al` copies a run folder as hard links: what the resumed run appends to a monitor log, or the recovery script
    DeepSpeed copies beside the tags at each save, went into the other name too (the copy made executable)."""
    from elsa_ds.files.handed import own_copies
    from elsa_ds.zero.checkpoint_save import clear_for_save, discard_unpublished_tag

    snapshot, run = tmp_path / "snapshot", tmp_path / "run"
    (snapshot / "monitor" / "elsa").mkdir(parents=True)
    (snapshot / "checkpoints").mkdir()
    (snapshot / "monitor" / "elsa" / "loss.csv").write_text("step,loss\n2,5.0\n")
    (snapshot / "checkpoints" / "zero_to_fp32.py").write_text("the snapshot's script")
    shutil.copytree(snapshot, run, copy_function=os.link)  # cp -al
    own_copies(run / "monitor")
    with (run / "monitor" / "elsa" / "loss.csv").open("a") as log:
        log.write("4,4.0\n")
    assert (snapshot / "monitor" / "elsa" / "loss.csv").read_text() == "step,loss\n2,5.0\n"
    assert (run / "monitor" / "elsa" / "loss.csv").read_text() == "step,loss\n2,5.0\n4,4.0\n"
    assert [p.name for p in (run / "monitor" / "elsa").iterdir()] == ["loss.csv"]
    clear_for_save(run / "checkpoints", "global_step4")
    assert not (run / "checkpoints" / "zero_to_fp32.py").exists()
    assert (snapshot / "checkpoints" / "zero_to_fp32.py").read_text() == "the snapshot's script"
    clear_for_save(snapshot / "checkpoints", "global_step4")  # now of one name: set aside, and a save that fails puts it back
    assert (snapshot / "checkpoints" / ".zero_to_fp32.py.before-save").read_text() == "the snapshot's script"
    (snapshot / "checkpoints" / "latest").write_text("global_step2")
    discard_unpublished_tag(snapshot / "checkpoints", "global_step4")
    assert sorted(p.name for p in (snapshot / "checkpoints").iterdir()) == ["latest", "zero_to_fp32.py"]
    assert (snapshot / "checkpoints" / "zero_to_fp32.py").read_text() == "the snapshot's script"


# ---- one opener for every file handed over: never waits, never follows a link it was not told to, leaks nothing --------
def test_every_reader_of_a_handed_file_opens_it_through_one_opener_that_never_waits(tmp_path):
    """JSON, torch files, safetensors headers and model cards open a file from elsewhere through
    ``regular_file.open_regular``: a FIFO is refused as an OSError naming its path and what it is (a reader quoting
    ``strerror`` says it), a folder is IsADirectoryError naming the path, a link is refused unless followed, and no
    refusal keeps a descriptor."""
    import errno

    from elsa_ds import json_data
    from elsa_ds.regular_file import NotRegularFile, open_regular

    (tmp_path / "a.json").write_text('{"k": 1}')
    os.mkfifo(fifo := tmp_path / "p.json")
    (link := tmp_path / "l.json").symlink_to("a.json")
    (folder := tmp_path / "d.json").mkdir()
    before = len(os.listdir("/proc/self/fd"))
    for read in (lambda p: open_regular(p, follow=True), json_data.read_text, json_data.read):
        with pytest.raises(NotRegularFile) as fifo_err:
            read(fifo)
        assert (fifo_err.value.filename, fifo_err.value.errno) == (str(fifo), errno.EINVAL)
        assert fifo_err.value.strerror.startswith("not a regular file") and str(fifo) in str(fifo_err.value)
        with pytest.raises(IsADirectoryError, match=re.escape(str(folder))):
            read(folder)
    assert json_data.read(link) == {"k": 1}  # a JSON file is read where its link leads, as open() reads it
    with pytest.raises(NotRegularFile) as link_err:
        open_regular(link)
    assert (link_err.value.what, link_err.value.errno) == ("a link", errno.ELOOP)
    with open_regular(link, follow=True) as fh:
        assert fh.read() == b'{"k": 1}'
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_key_named_twice_is_said_as_such_by_the_readers_that_refuse_it(tmp_path):
    """A review: readers that refuse a repeated key said "not valid JSON" or "DuplicateKey: ..." for it; each names it."""
    from elsa_ds.evaluation.tables import load_result
    from elsa_ds.files.weight_files import read_index
    from elsa_ds.sparse.folder import read_index as sparse_index
    from elsa_ds.sparse.integrity import SparseCheckpointError

    (result := tmp_path / "r.json").write_text('{"ppl": 1, "ppl": 2}')
    with pytest.raises(ElsaError, match=r'--compare .*r\.json: the key "ppl" appears twice in one object'):
        load_result(result)
    (index := tmp_path / "i.json").write_text('{"weight_map": {"w": "a.safetensors", "w": "b.safetensors"}}')
    assert read_index(index, ElsaError) == {"w": "b.safetensors"}  # a model's index, read as transformers reads it
    with pytest.raises(SparseCheckpointError, match=r'i\.json: the key "w" appears twice in one object'):
        sparse_index(index)


@pytest.mark.parametrize("text", ["plain", "a b", "it's", "new\nline", "tab\tesc\x1b", "x\\x41!", "é\u2028😀",
                                  os.fsdecode(b"bad\xff\xfe'!"), "lone \ud800 surrogate", "$(touch X)`y`", "-rf", ""])
def test_a_suggested_command_names_each_path_as_bash_reads_it_back(text):
    """``quoting.shell_word``: what a refusal suggests to run (``mv STAGING OUTPUT``) reads back as the same bytes, on
    one line whatever the path holds (a newline, bytes that are not UTF-8); it never raises (a review: a surrogate that
    no file name decodes to)."""
    from elsa_ds.quoting import one_line, shell_word

    word = shell_word(text)
    assert one_line(word) == word and "\n" not in word
    read = subprocess.run(["bash", "-c", "printf '%s\\0' " + word], capture_output=True, check=True).stdout
    expected = text.encode("utf-8", "surrogatepass") if "\ud800" in text else os.fsencode(text)
    assert read == expected + b"\0", word
