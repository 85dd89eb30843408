"""`python -m ktlong.bench NAME [options]`: run one benchmark and print its table."""

import sys

from ktlong.errors import KtlongError
from ktlong.cli import interrupted, print_error
from ktlong.bench import (attention, cache_hits, capture, context_limit, cpu_weights, decode, decode_op,
                          follow_up, kept_keys, kv_fidelity, prefill, random_gguf, selection_drift, serve,
                          structured)

BENCHES = {"prefill": prefill.main, "attention": attention.main, "capture": capture.main,
           "decode-op": decode_op.main, "decode": decode.main, "kv-fidelity": kv_fidelity.main,
           "follow-up": follow_up.main, "context-limit": context_limit.main,
           "selection-drift": selection_drift.main, "structured": structured.main,
           "cpu-weights": cpu_weights.main, "cache-hits": cache_hits.main, "kept-keys": kept_keys.main,
           "serve": serve.main, "random-gguf": random_gguf.main}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    usage = f"usage: python -m ktlong.bench {{{','.join(BENCHES)}}} [options]"
    if argv[:1] in (["-h"], ["--help"]):
        print(f"{usage}\n\n{__doc__.strip()}\n`python -m ktlong.bench NAME --help` describes one benchmark and its "
              "options.")
        return 0
    if not argv or argv[0] not in BENCHES:
        print(usage, file=sys.stderr)
        return 2
    try:
        return BENCHES[argv[0]](argv[1:])
    except KtlongError as e:
        print_error(e)
        return 2
    except KeyboardInterrupt:
        return interrupted()


if __name__ == "__main__":
    sys.exit(main())
