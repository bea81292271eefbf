"""The accumulation probe at every shape and K of the gpu test, kept whole for analysis on the CPU: per record
the measured ancestor sizes S(i, j) (``lca_sizes``) in one npz and the rest (arithmetic probes, findings) in
a JSON file. Usage: python3 .ci/gpu/accumulation_dump.py OUT"""
import io
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from dora_num.numerics.standard_model import TC_BLOCK_K
from dora_num.studies.bounds.accumulation import analyze, bound_factor, lca_sizes, run_probes


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    arrays, meta = {}, []
    t0 = time.perf_counter()
    shapes = [(p, m, n) for r in (8, 16, 64, 256, 384) for p, m, n in
              (("U split", 8192, 3 * r), ("U", 8192, r), ("G split", 3 * r, 3 * r), ("G", r, r))]
    for fmt in ("bf16", "fp16"):
        for shape in shapes:
            for K in (64, 384, 4096, TC_BLOCK_K):
                rec = run_probes(lambda a, b: torch.mm(a, b, out_dtype=torch.float32), fmt, K, shape=shape,
                                 device="cuda")
                f = analyze(rec)
                b = bound_factor(f)
                key = f"{fmt}|{shape[0]}|{shape[1]}|{shape[2]}|{K}"
                S = lca_sizes(rec)
                for i, s in S.items():
                    arrays[f"{key}|{i}"] = s.astype(np.int32)
                meta.append({"key": key, **{k: v for k, v in rec.items() if k not in ("order_ij", "order_out")},
                             "findings": {k: v for k, v in f.items() if k != "shape"}, "bound": b})
                print(f"{key}: explained={f['explained']} block_k={f.get('block_k')} splits={f.get('splits')} "
                      f"factor={b.get('factor')} {time.perf_counter() - t0:.0f}s", flush=True)
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    (out / "accumulation_S.npz").write_bytes(buf.getvalue())
    (out / "accumulation_meta.json").write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                                            "torch": torch.__version__, "cuda": torch.version.cuda,
                                                            "records": meta}, default=str))
    print(torch.cuda.get_device_name(), torch.__version__, torch.version.cuda, flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
