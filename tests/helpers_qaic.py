"""The qaic backend's test kit, shared by test_qaic_backend.py and test_finish_handoff.py: the
tiny recipe for the two-role Llama pair (its fixtures, `qaic_models` and `qaic_recipe`, are in
conftest.py), a build through the library, and a recording stand-in for qaic-compile that checks
what the real compiler would be given."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from qpcbuild.bundle import BuildResult, build_bundle
from qpcbuild.cache import Cache
from qpcbuild.plan import make_plan
from qpcbuild.recipe import load_recipe

ROLES = ("target", "draft")
LAYERS = {"target": 2, "draft": 1}


def write_recipe(folder: Path, models: dict[str, Path], *, k="3", kv="float16",
                 fmt="named", target_hw="{device_group: [0], num_cores: 10}",
                 draft_hw="{device_group: [0], num_cores: 6}", num_cards=1) -> Path:
    path = folder / "tiny-qaic.yaml"
    path.write_text(f"""\
schema: 1
name: tiny-qaic
target:
  model: {models["target"]}
draft:
  method: draft_model
  model: {models["draft"]}
speculation:
  num_speculative_tokens: {k}
shapes:
  batch_size: 1
  prefill_seq_len: 8
  ctx_len: 64
precision:
  kv_cache_dtype: {kv}
hardware:
  card: cloud-ai-100-ultra
  num_cards: {num_cards}
  target: {target_hw}
  draft: {draft_hw}
  specializations_format: {fmt}
backends: [qaic, onnxruntime]
""")
    return path


def build(recipe: Path, cache: Path, out: Path, *overrides: str, **kw) -> BuildResult:
    plan = make_plan(load_recipe(recipe, list(overrides)))
    return build_bundle(plan, cache=Cache(cache), out=out, **kw)


# ---------------------------------------------------------------- stand-in compiler
STAND_IN = '''\
#!{python}
"""Stand-in for qaic-compile: records how it was called and what it was given."""
import fcntl, json, os, signal, sys

LOG, MODE, FAIL_ROLE = {log!r}, {mode!r}, {fail_role!r}
opts = dict(a.split("=", 1) for a in sys.argv[1:] if a.startswith("-") and "=" in a)
role = opts.get("-m", "?").split("/")[0]
record = {{"argv": sys.argv, "cwd": os.getcwd(), "role": role, "inputs": {{}}}}
for flag in ("-m", "-network-specialization-config", "-custom-IO-list-file",
             "-mdp-load-partition-config"):
    if flag not in opts:
        continue
    path = opts[flag]
    if not os.path.isfile(path):
        print(f"stand-in: {{flag}} names {{path}}, which does not exist", file=sys.stderr)
        sys.exit(3)
    if flag == "-m":
        data = path + ".data"
        record["inputs"][flag] = {{"size": os.path.getsize(path),
                                   "data_size": os.path.getsize(data) if os.path.isfile(data)
                                   else None}}
    else:
        with open(path) as fh:
            record["inputs"][flag] = fh.read()
# One compile.sh per role may run at once: read, append and write the log under a lock.
with open(LOG + ".lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    calls = []
    if os.path.exists(LOG):
        with open(LOG) as fh:
            calls = json.load(fh)
    calls.append(record)
    with open(LOG, "w") as fh:
        json.dump(calls, fh)
print(f"stand-in compiling {{role}}: {{len(sys.argv) - 1}} arguments", flush=True)
if role == FAIL_ROLE:
    if MODE == "exit1":
        print(f"ERROR: lowering failed in {{role}} at node /model/layers.0/self_attn", flush=True)
        sys.exit(1)
    if MODE == "sigsegv":
        print(f"about to crash while compiling {{role}}", flush=True)
        import resource
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file in the bundle
        os.kill(os.getpid(), signal.SIGSEGV)
    if MODE == "no-qpc":
        print(f"finished {{role}} without writing a program", flush=True)
        sys.exit(0)
out = opts["-aic-binary-dir"]
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, "programqpc.bin"), "wb") as fh:
    fh.write(b"QPC stand-in " + role.encode())
'''


class StandIn:
    """The stand-in compiler, written into `folder`: it compiles (mode "ok"), or for `fail_role`
    exits 1 ("exit1"), crashes ("sigsegv") or writes no program ("no-qpc"); `calls` are what
    it was given, call by call."""

    def __init__(self, folder: Path, mode: str = "ok", fail_role: str | None = None):
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"qaic-compile-{mode}"
        self.log = folder / f"calls-{mode}.json"
        self.path.write_text(STAND_IN.format(python=sys.executable, log=str(self.log),
                                             mode=mode, fail_role=fail_role))
        self.path.chmod(0o755)

    @property
    def calls(self) -> list[dict]:
        return json.loads(self.log.read_text()) if self.log.exists() else []
