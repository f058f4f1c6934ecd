"""Say what ``make demo`` made: the synthesized stacks (resources, cdk-nag, hourly cost)
and the local training run (summary, metrics and curves, checkpoints, final model).

    python -m ray_train_eks.demo cdk.out [demo-out]
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path


def describe_assembly(outdir: Path) -> str:
    """A short human summary of a cloud assembly folder."""
    manifest = json.loads((outdir / "manifest.json").read_text())
    lines = [f"Cloud assembly: {outdir.resolve()} ({_size_mib(outdir):.0f} MiB, mostly the kubectl and AWS CLI Lambda layers)"]
    for name, artifact in sorted(manifest["artifacts"].items()):
        if artifact["type"] != "aws:cloudformation:stack":
            continue
        template_path = outdir / artifact["properties"]["templateFile"]
        template = json.loads(template_path.read_text())
        counts = Counter(resource["Type"] for resource in template["Resources"].values())
        lines.append(f"Stack {name} ({artifact['environment']}): {template_path}")
        lines.append(f"  {sum(counts.values())} resources; main ones:")
        for type_ in ("AWS::EKS::Cluster", "AWS::EKS::Nodegroup", "AWS::EC2::LaunchTemplate", "Custom::AWSCDK-EKS-HelmChart",
                      "AWS::EKS::Addon", "AWS::S3::Bucket", "AWS::EKS::PodIdentityAssociation", "AWS::CloudWatch::Dashboard",
                      "AWS::CloudWatch::Alarm"):
            if counts.get(type_):
                lines.append(f"    {counts[type_]:>2} x {type_}")
        cost = template.get("Outputs", {}).get("EstimatedCostUsdPerHour")
        if cost:
            lines.append(f"  Estimated cost while deployed: {cost['Description']}")
        if "DashboardUrl" in template.get("Outputs", {}):
            lines.append("  CloudWatch dashboard: stack output DashboardUrl after deploy; its layout is docs/dashboard.svg")
    dist = Path("dist")
    if dist.is_dir():
        lines.append(f"Kubernetes manifests for kubectl/GitOps (what cdk deploy applies): {', '.join(str(p) for p in sorted(dist.glob('*.yaml')))}")
    report = outdir / "validation-report.json"
    if report.exists():
        for plugin in json.loads(report.read_text())["pluginReports"]:
            lines.append(f"cdk-nag {plugin['pluginName']}: {plugin['conclusion']}, {len(plugin['violations'])} unacknowledged findings")
    return "\n".join(lines)


def describe_training(demo_dir: Path) -> str:
    """Where the local training run put things, from its log and storage folder."""
    log = demo_dir / "train.log"
    lines = [f"Local training run (python -m training.train --preset tiny-cpu): log {log}, Ray's own log {demo_dir / 'ray.log'}"]
    summaries = [line for line in log.read_text().splitlines() if line.startswith("{")] if log.exists() else []
    if not summaries:
        lines.append("  no summary found: the run failed; see the logs above")
        return "\n".join(lines)
    summary = json.loads(summaries[-1])
    eval_text = f", eval loss on held-out rows {summary['eval_loss']:.3f}" if summary.get("eval_loss") is not None else ""
    lines.append(
        f"  loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f} over {summary['steps']} steps{eval_text}, "
        f"{summary['tokens_per_s']:,.0f} tokens/s on 2 CPU workers"
    )
    lines.append(f"  metrics of every step (one JSON object a line): {summary['metrics']}")
    lines.append(f"  the run's curves (loss, eval loss, learning rate, tokens/s): {summary['curves']}")
    lines.append(f"  last checkpoint (sharded, torch.distributed.checkpoint): {summary['checkpoint']}")
    lines.append(f"  final model (safetensors + tokenizer, loads with from_pretrained): {summary['final_model']}")
    tracking = summary.get("tracking")
    record = Path(summary["metrics"]).parent / "mlflow_run.json"
    uri = json.loads(record.read_text())["tracking_uri"] if tracking and record.exists() else None
    if tracking:
        lines.append(f"  tracked in MLflow ({uri}): run {tracking['mlflow_run_id']}; open the MLflow UI on it: make mlflow-ui")
    lines.append("  resume it: .venv/bin/python -m training.train --preset tiny-cpu --storage-path demo-out/runs --max-steps 40"
                 + (f" --tracking-uri {uri}" if uri else ""))
    lines.append("After make deploy, more runs without CloudFormation: .venv/bin/ray-train-eks submit --name NAME -- OPTIONS "
                 "(add --dry-run to print the RayJob it would create, no AWS needed); list, status, logs, stop: "
                 "docs/fine-tuning.md")
    return "\n".join(lines)


def _size_mib(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20


def main(argv: list[str] | None = None) -> int:
    """``python -m ray_train_eks.demo cdk.out [demo-out]``: what ``make demo`` made."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m ray_train_eks.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("assembly", nargs="?", default="cdk.out", help="the cloud assembly folder (default cdk.out)")
    parser.add_argument("training", nargs="?", help="the local run's folder (make demo's demo-out)")
    args = parser.parse_args(argv)
    print()
    print(describe_assembly(Path(args.assembly)))
    if args.training:
        print(describe_training(Path(args.training)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
