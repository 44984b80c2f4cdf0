"""A trainer process for the weight-transfer tests: sends a checkpoint's tensors to a
gateway through the ``cpu`` backend with ``client.weight_sync.send_weights``, or (with
``--die-after N``) opens an update, sends N one-tensor buckets and SIGKILLs itself.

    python -m tests.weight_trainer ADDRESS MODEL_DIR [--version V] [--pause keep]
"""

from __future__ import annotations

import argparse
import glob
import os
import signal
import sys


def checkpoint_tensors(model_dir: str) -> list[tuple[str, object]]:
    """The checkpoint's tensors in file order (by layer: what a trainer's state dict is)."""
    from safetensors.torch import load_file

    tensors: dict[str, object] = {}
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        tensors.update(load_file(path))
    return list(tensors.items())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("address")
    parser.add_argument("model_dir")
    parser.add_argument("--version", default=None)
    parser.add_argument("--pause", default="keep")
    parser.add_argument("--die-after", type=int, default=None, metavar="BUCKETS")
    args = parser.parse_args()

    from client import Client
    from client.weight_sync import buffer_folder, send_weights, shared_memory_buckets

    tensors = checkpoint_tensors(args.model_dir)
    with Client(args.address, name="trainer", heartbeat_interval_s=0.5) as client:
        if args.die_after is None:
            done = send_weights(client, tensors, version=args.version, pause=args.pause)
            print("FINISHED", done.result, flush=True)
            return
        directory = buffer_folder(client.init_weight_transfer_engine({}))
        print("FOLDER", directory, flush=True)
        client.start_weight_update()
        with shared_memory_buckets(tensors, bucket_bytes=1, directory=directory) as buckets:
            for sent, update_info in enumerate(buckets, start=1):
                client.update_weights(update_info)
                if sent == args.die_after:
                    print("DYING", flush=True)
                    sys.stdout.flush()
                    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
