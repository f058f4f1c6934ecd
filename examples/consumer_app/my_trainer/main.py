"""The consumer's entrypoint: what their RayJob runs (``python -m my_trainer.main``).

A stand-in for a real training script: it joins the Ray cluster the RayJob made and
reports what it sees, so the wiring can be checked end to end.
"""

import argparse
import json


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args()
    import ray

    ray.init()
    print(json.dumps({"epochs": args.epochs, "cluster_resources": ray.cluster_resources()}))


if __name__ == "__main__":
    main()
