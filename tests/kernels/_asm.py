"""PTX and TTGIR of kernel variants for sm_90 / sm_80 (compile_variants keeps only the SASS), and the
bank conflicts of the grouped convs' tap-pair copies read from that PTX."""

import json
import os
import subprocess
import sys

_ASM_SCRIPT = r"""
import json, sys, importlib
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
out = []
for v in json.load(sys.stdin):
    fn = getattr(importlib.import_module(v["module"]), v["name"])
    k = triton.compile(ASTSource(fn, dict(map(tuple, v["signature"])), {tuple(p): x for p, x in v["constexprs"]},
                                 {tuple(p): x for p, x in v["attrs"]}),
                       target=GPUTarget("cuda", v["arch"], 32), options=dict(map(tuple, v["options"])))
    out.append(dict(ttgir=k.asm["ttgir"], ptx=k.asm["ptx"]))
json.dump(out, sys.stdout)
"""


def compile_asm(variants):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-c", _ASM_SCRIPT], input=json.dumps([v.to_json() for v in variants]),
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def tap_copy_wavefronts(ptx: str) -> tuple[int, int]:
    """(wavefronts, conflict-free count) of warp 0's 16-byte shared stores and ldmatrix.x4 loads: the conv's
    tap-pair copies and their reads for the batched mma.sync (convfirstnet.analysis.shared)."""
    from convfirstnet.analysis.shared import ptx_shared_accesses

    acc = [a for a in ptx_shared_accesses(ptx)
           if a.opcode.startswith("ldmatrix.sync.aligned.m8n8.x4")
           or (a.opcode.startswith("st.shared") and a.opcode.endswith("v4.b32"))]
    return sum(a.wavefronts for a in acc), sum(a.ideal for a in acc)
