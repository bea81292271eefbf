"""Run by tests/studies/gradient/test_dg_accuracy.py in a fresh interpreter: the MiniLM capture of notebook 06,
one module, printed as sha256 of its tensors rounded once to each studied dtype."""
import hashlib
import json

import torch

from dora_num.studies.gradient import dg_accuracy as da

cap = da.capture_minilm(steps_before=3, batch_size=16, modules=1, lr=1e-3, seed=0)
out = {}
for name, c in cap.items():
    for key in ("base", "lora", "D"):
        for dt in (torch.float32, torch.bfloat16, torch.float16):
            out[f"{name} {key} {dt}"] = hashlib.sha256(c[key].to(dt).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
print(json.dumps(out))
