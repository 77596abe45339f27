"""Host threads: in the `qpcbuild` command the draft and target sessions share one pool over all
CPUs unless the recipe sets `onnxruntime.intra_op_threads` (then each role gets a pool of that
size); a library caller gets a pool per session over all CPUs. Run in fresh processes: ONNX
Runtime's shared pool belongs to the process."""

import json
import os
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from qpcbuild.cli import app

PROBE = """
import json, sys
from qpcbuild.ort_threads import allow_shared_pool, host_threads
from qpcbuild.runtime.loader import load
if sys.argv[2] == "command":
    allow_shared_pool()  # what launch.py does for the `qpcbuild` command
gen = load(sys.argv[1], verify="none")
out = gen.generate(["def add(a, b):"], max_new_tokens=12)
print(json.dumps({"host": host_threads(),
                  "roles": {r: [s.shared_pool, s.threads] for r, s in
                            (("target", gen.target), ("draft", gen.draft))},
                  "tokens": out.rows[0].tokens}))
"""


def _probe(bundle: Path, cpus: set[int] | None = None, process: str = "command") -> dict:
    def pin():  # what a container's CPU set or `taskset` does to this process
        if cpus:
            os.sched_setaffinity(0, cpus)
    proc = subprocess.run([sys.executable, "-c", PROBE, str(bundle), process], capture_output=True,
                          text=True, timeout=300, preexec_fn=pin)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_roles_share_one_pool_over_the_cpus_the_process_may_use(demo_build):
    bundle, _ = demo_build
    seen = _probe(bundle)
    assert seen["host"] == len(os.sched_getaffinity(0))
    assert seen["roles"] == {"target": [True, seen["host"]], "draft": [True, seen["host"]]}
    one_cpu = _probe(bundle, cpus={sorted(os.sched_getaffinity(0))[0]})
    assert one_cpu["host"] == 1 and one_cpu["roles"]["draft"] == [True, 1]
    assert one_cpu["tokens"] == seen["tokens"]  # threads change the speed, never the tokens
    library = _probe(bundle, process="library")
    assert library["roles"] == {"target": [False, seen["host"]], "draft": [False, seen["host"]]}
    assert library["tokens"] == seen["tokens"]


def test_the_command_opens_other_sessions_next_to_the_shared_pool(demo_build, tmp_path):
    """Once the shared pool exists every session of the process must use it: `bench` opens its
    bandwidth probe after the bundle's sessions (this failed when the probe had its own pool)."""
    bundle, _ = demo_build
    proc = subprocess.run([sys.executable, "-m", "qpcbuild", "bench", str(bundle),
                           "--num-prompts", "1", "--max-new-tokens", "8", "--repeats", "1",
                           "--ks", "4", "--methods", "draft_model", "--peers", "none",
                           "--no-plot", "--json-out", str(tmp_path / "bench.json")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["baseline"]["tokens_per_s"]["mean"] > 0


def test_explicit_threads_give_each_role_its_own_pool(demo_build, tmp_path):
    _, cache = demo_build
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "bundle"
    result = CliRunner().invoke(app, ["compile", str(root / "recipes" / "demo.yaml"), "-o",
                                      str(out), "--cache-dir", str(cache),
                                      "--set", "onnxruntime.intra_op_threads=1"])
    assert result.exit_code == 0, result.output
    seen = _probe(out)
    assert seen["roles"] == {"target": [False, 1], "draft": [False, 1]}
