"""A run that must end before a time (training/resilience/deadline.py): ``--stop-before``, or the end of the
Capacity Block its GPU nodes run on, less the 40 minutes before it when its nodes may go; checked before Ray starts, resolved by the
driver, decided after each step by every rank together, and said by ``ray-train-eks status``. The loop's
stop runs the real training loop in this process on one gloo rank (as test_deliberate_stops.py), on a
clock the test sets."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import pytest

import ray.train
from training.config import ConfigError, parse_config
from training.resilience import deadline
from training.resilience.deadline import (CAPACITY_BLOCK_NODES_ENV, CAPACITY_BLOCKS_ENV, SAFETY_MARGIN_S, TERMINATION_LEAD_S, Deadline, resolve,
                                          should_stop)

BLOCK_END = datetime(2026, 12, 5, 14, 0, tzinfo=timezone.utc)


@pytest.mark.parametrize("given, said", [
    ("tomorrow", "stop_before='tomorrow' is not an ISO-8601 time; give it in UTC, e.g. --stop-before 20"),
    ("2030-01-01T09:00", "stop_before='2030-01-01T09:00' has no time zone; add Z for UTC, e.g. --stop-before 2030-01-01T09:00Z"),
    ("2020-01-01T09:00:00Z", "stop_before='2020-01-01T09:00:00Z' is in the past (now 20"),
])
def test_a_stop_time_the_run_cannot_use_is_refused_before_ray_starts(given, said):
    with pytest.raises(ConfigError) as refused:
        parse_config(["--preset", "tiny-cpu", "--storage-path", "/tmp/runs", "--stop-before", given])
    assert said in str(refused.value)
    assert parse_config(["--preset", "tiny-cpu", "--storage-path", "/tmp/runs", "--stop-before", "2030-01-01T09:00:00+02:00"])


def test_the_stop_time_is_the_given_one_else_the_earliest_blocks_end_less_ec2s_lead(capsys):
    from botocore.stub import Stubber

    from training.resilience.deadline import ec2_client

    environ = {CAPACITY_BLOCKS_ENV: "cr-0aaa, cr-0bbb", "AWS_REGION": "us-east-2"}
    assert resolve("2030-01-01T00:00:00Z", environ).reason == "--stop-before 2030-01-01T00:00:00Z"
    assert resolve("none", environ) is None and resolve(None, {}) is None
    client = ec2_client(environ)
    assert client.meta.region_name == "us-east-2"
    with Stubber(client) as stub:
        stub.add_response("describe_capacity_reservations", {"CapacityReservations": [
            {"CapacityReservationId": "cr-0bbb", "EndDate": BLOCK_END.replace(hour=20)},
            {"CapacityReservationId": "cr-0aaa", "EndDate": BLOCK_END}]},
            {"CapacityReservationIds": ["cr-0aaa", "cr-0bbb"]})
        found = resolve(None, environ, client=client)
    assert found.stop_at == BLOCK_END.timestamp() - TERMINATION_LEAD_S - SAFETY_MARGIN_S  # 13:15 UTC
    assert (found.block_id, found.block_ends) == ("cr-0aaa", BLOCK_END.timestamp())
    assert found.reason == ("the capacity block cr-0aaa ends at 2026-12-05T14:00:00Z (its nodes go from "
                            "2026-12-05T13:20:00Z)")
    assert found.record() == {"stop_before": "2026-12-05T13:15:00Z",
                              "capacity_block": {"id": "cr-0aaa", "ends": "2026-12-05T14:00:00Z"}}
    assert Deadline.from_dict(found.to_dict()) == found
    # The pods' role may not describe them: a warning, and the run goes on without a stop time.
    with Stubber(client) as stub:
        stub.add_client_error("describe_capacity_reservations", service_error_code="UnauthorizedOperation",
                              http_status_code=403, service_message="You are not authorized to perform this operation.")
        assert resolve(None, environ, client=client) is None
    assert ("[train] WARNING: could not read the end of capacity block(s) cr-0aaa, cr-0bbb (ec2:DescribeCapacityReservations: "
            "ClientError: An error occurred (UnauthorizedOperation)") in capsys.readouterr().err


def test_blocks_selected_by_tags_set_the_stop_time_too():
    """Karpenter's reservations by tags: the driver asks EC2 for the active or scheduled reservations with
    those tags and takes the Capacity Blocks among them (an ODCR there does not end)."""
    from botocore.stub import Stubber

    from training.resilience.deadline import CAPACITY_BLOCK_TAGS_ENV, ec2_client

    environ = {CAPACITY_BLOCK_TAGS_ENV: '{"team": "ml"}', "AWS_REGION": "us-east-2"}
    client = ec2_client(environ)
    with Stubber(client) as stub:
        stub.add_response("describe_capacity_reservations", {"CapacityReservations": [
            {"CapacityReservationId": "cr-0ccc", "ReservationType": "default", "EndDate": BLOCK_END.replace(hour=1)},
            {"CapacityReservationId": "cr-0aaa", "ReservationType": "capacity-block", "EndDate": BLOCK_END}]},
            {"Filters": [{"Name": "tag:team", "Values": ["ml"]}, {"Name": "state", "Values": ["active", "scheduled"]}]})
        found = resolve(None, environ, client=client)
    assert (found.block_id, found.stop_at) == ("cr-0aaa", BLOCK_END.timestamp() - TERMINATION_LEAD_S - SAFETY_MARGIN_S)


def test_the_run_stops_where_the_next_step_and_a_checkpoint_would_pass_the_stop_time():
    stop_at = 10_000.0
    # 60 s steps, 90 s checkpoints: the next step, a step to spare and the checkpoint take 210 s.
    assert not should_stop(stop_at - 211, stop_at, step_seconds=60, checkpoint_seconds=90)
    assert should_stop(stop_at - 210, stop_at, step_seconds=60, checkpoint_seconds=90)
    # No checkpoint measured yet: as long as a step.
    assert not should_stop(stop_at - 181, stop_at, step_seconds=60, checkpoint_seconds=None)
    assert should_stop(stop_at - 180, stop_at, step_seconds=60, checkpoint_seconds=None)


def test_an_extension_moves_the_stop_only_where_karpenter_runs_the_nodes_and_an_unreachable_ec2_keeps_it(capsys):
    """A managed node group's scale-down is EKS's scheduled action, made at the block's first end (EKS
    User Guide, "Capacity Blocks for ML"); no guide says an extension moves it, so there the stop stays,
    said. Karpenter reads the block's end live (expiration controller), so there an extension moves it.
    EC2 refusing the second read keeps the planned stop, and says that (not "goes on without one")."""
    from botocore.stub import Stubber

    from training.resilience.deadline import ec2_client, extended

    planned = Deadline(stop_at=BLOCK_END.timestamp() - TERMINATION_LEAD_S - SAFETY_MARGIN_S, reason="first end",
                       block_id="cr-0aaa", block_ends=BLOCK_END.timestamp())
    later = {"CapacityReservations": [{"CapacityReservationId": "cr-0aaa", "EndDate": BLOCK_END.replace(hour=20)}]}
    for nodes, moved in (("karpenter", True), ("node-group", False), (None, False)):
        environ = {CAPACITY_BLOCKS_ENV: "cr-0aaa", "AWS_REGION": "us-east-2", **({CAPACITY_BLOCK_NODES_ENV: nodes} if nodes else {})}
        client = ec2_client(environ)
        with Stubber(client) as stub:
            stub.add_response("describe_capacity_reservations", later, {"CapacityReservationIds": ["cr-0aaa"]})
            found = extended(planned, environ, client=client)
        assert (found is not None and found.block_ends == BLOCK_END.replace(hour=20).timestamp()) is moved
        said = capsys.readouterr().err
        assert ("the GPU nodes run in a managed node group, which EKS scales to 0 at 40 min before the block's first end"
                in said) is not moved
        assert moved or "the run stops as planned, by 2026-12-05T13:15:00Z; resume it with" in said
    with Stubber(client) as stub:
        stub.add_client_error("describe_capacity_reservations", service_error_code="RequestLimitExceeded",
                              http_status_code=503, service_message="Request limit exceeded.")
        assert extended(planned, environ, client=client) is None
    said = capsys.readouterr().err
    assert ("[train] WARNING: could not read the end of capacity block(s) cr-0aaa again (ec2:DescribeCapacityReservations: "
            "ClientError: An error occurred (RequestLimitExceeded)") in said
    assert said.rstrip().endswith("the run stops as planned, by 2026-12-05T13:15:00Z") and "without a stop time" not in said


def test_the_loop_checkpoints_and_stops_resumable_before_the_stop_time_an_extended_block_moves(tiny_loop, tmp_path,
                                                                                               monkeypatch, capsys):
    """A clock where each step takes 100 s and the run's Capacity Block first ends so that its stop time is
    250 s after the start. EC2 extends a block under the same id with a later EndDate: where the run would
    stop it reads the end again, now 400 s later, so it goes on to the new stop. There (after step 8) the
    end it reads has not moved: step 8 is checkpointed (the upload waited for), reported with why, and the
    loop ends without an export; run.json keeps the block's new end and the stop time."""
    from botocore.stub import Stubber

    from training.resilience.deadline import ec2_client

    reports, clock = [], [0.0]

    def report(metrics, checkpoint=None, **upload):
        reports.append((dict(metrics), checkpoint is not None, upload.get("checkpoint_upload_mode")))
        if checkpoint is None or not metrics.get("stopped_before"):
            clock[0] += 100.0

    first_end = 250.0 + TERMINATION_LEAD_S + SAFETY_MARGIN_S
    environ = {CAPACITY_BLOCKS_ENV: "cr-0aaa", CAPACITY_BLOCK_NODES_ENV: "karpenter", "AWS_REGION": "us-east-2"}
    client = ec2_client(environ)
    stub = Stubber(client)
    for _ in range(2):  # where it would stop first, and where it stops
        stub.add_response("describe_capacity_reservations", {"CapacityReservations": [
            {"CapacityReservationId": "cr-0aaa", "EndDate": datetime.fromtimestamp(first_end + 400, timezone.utc)}]},
            {"CapacityReservationIds": ["cr-0aaa"]})
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(deadline, "ec2_client", lambda environ: client)
    monkeypatch.setattr(deadline, "now", lambda: clock[0])
    stop = Deadline(stop_at=250.0, reason="the capacity block cr-0aaa ends at 1970-01-01T00:49:10Z", block_id="cr-0aaa",
                    block_ends=first_end)
    with stub:
        tiny_loop(report, max_steps=12, checkpoint_every=20, checkpoint_mode="async", extra={"_deadline": stop.to_dict()})
        stub.assert_no_pending_responses()

    assert [(m["step"], saved) for m, saved, _ in reports] == [(step, step == 8) for step in range(1, 9)]
    assert ("[train] the capacity block was extended: the capacity block cr-0aaa ends at 1970-01-01T00:55:50Z (its nodes go "
            "from 1970-01-01T00:15:50Z); the run goes on and stops by 1970-01-01T00:10:50Z") in capsys.readouterr().out
    metrics, _, mode = reports[-1]
    assert mode == ray.train.CheckpointUploadMode.SYNC
    assert metrics["stopped_before"] == ("the capacity block cr-0aaa ends at 1970-01-01T00:55:50Z (its nodes go from "
                                         "1970-01-01T00:15:50Z); resume with `ray-train-eks submit --resume <run>` on new "
                                         "capacity (checkpointed at step 8 of 12)")
    folder = tmp_path / "runs" / "tiny-cpu-sft"
    assert not (folder / "final").exists() and not (folder / "stopped.json").exists()  # not done, and not failed
    about = json.loads((folder / "run.json").read_text())
    assert about["stop_before"] == "1970-01-01T00:10:50Z"
    assert about["capacity_block"] == {"id": "cr-0aaa", "ends": "1970-01-01T00:55:50Z"}
    assert not ray.is_initialized()  # nothing here started a Ray of its own


def test_status_says_when_the_capacity_block_ends_and_when_the_run_stops():
    from ray_train_eks.cli.run_records import stop_time_line

    found = {"stop_before": "2026-12-05T13:25:00Z", "capacity_block": {"id": "cr-0aaa", "ends": "2026-12-05T14:00:00Z"}}
    now = BLOCK_END.timestamp() - (2 * 60 + 10) * 60
    assert stop_time_line(found, now) == ("capacity block cr-0aaa ends in 2 h 10 min (at 14:00 UTC; its nodes go from 40 min "
                                          "before): the run checkpoints and stops, resumable, by 13:25 UTC")
    assert stop_time_line(found, BLOCK_END.timestamp() + 1) == ("capacity block cr-0aaa ended at 2026-12-05T14:00:00Z (EC2 "
                                                                "reclaimed its instances)")
    given = {"stop_before": "2026-12-05T13:25:00Z"}
    assert stop_time_line(given, now) == ("--stop-before 2026-12-05T13:25:00Z: in 1 h 35 min, the run checkpoints and stops, "
                                          "resumable, by 13:25 UTC")
    assert stop_time_line({}, now) is None
