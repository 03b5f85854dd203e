"""TensorBoard's own reader against the JSON-lines metrics: every number of every step record
(members of nested objects as "key/member", the final object's under "final/") must come back as
the scalar of that tag at that step, and the config text as the text "config".
usage: tensorboard_oracle.py EVENT_DIR METRICS.jsonl CONFIG_SUBSTRING
exit 0: all equal; 1: a difference (printed); 3: tensorboard is not installed."""
import json
import math
import sys

try:
    from tensorboard.backend.event_processing import event_accumulator
except ImportError:
    print("tensorboard is not installed")
    sys.exit(3)


def flatten(obj, prefix, out):
    for k, v in obj.items():
        if k == "step" or isinstance(v, bool):
            continue
        if isinstance(v, (int, float)):
            out[prefix + k] = float(v)
        elif isinstance(v, dict):
            flatten(v, prefix + k + "/", out)


def main():
    ev_dir, metrics, config_part = sys.argv[1:4]
    acc = event_accumulator.EventAccumulator(ev_dir, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    got = {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}
    want, last = [], 0
    for line in open(metrics):
        rec = json.loads(line)
        vals = {}
        if rec.get("final"):
            flatten(rec, "final/", vals)
            step = last
        else:
            flatten(rec, "", vals)
            step = last = rec["step"]
        want += [(tag, step, v) for tag, v in vals.items()]
    bad = 0
    for tag, step, v in want:
        g = got.get(tag, {}).get(step)
        if g is None or not math.isclose(g, v, rel_tol=1e-6, abs_tol=1e-30):
            print(f"{tag} at step {step}: metrics {v}, tensorboard {g}")
            bad += 1
    texts = acc.Tensors("config") if "config" in acc.Tags()["tensors"] else []
    if not texts or config_part not in texts[0].tensor_proto.string_val[0].decode():
        print("text 'config' missing or without", repr(config_part))
        bad += 1
    print(f"{len(want)} values compared, {bad} different")
    return 1 if bad or not want else 0


sys.exit(main())
