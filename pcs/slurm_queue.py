"""What SLURM's queue says of jobs (``squeue``), for the sweep launcher waiting on its jobs and for ``pcs.status``.
Torch-free; the queue, not SLURM's accounting (``sacct``), which a cluster may not run."""
from __future__ import annotations

import shutil
import subprocess

# States after which a job runs no more. A requeued job is PENDING again, not ended.
ENDED_STATES = {"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
         "TIMEOUT"}
# States in which a job's process may be working.
RUNNING_STATES = {"CONFIGURING", "RUNNING", "COMPLETING", "SIGNALING", "STAGE_OUT"}


def queue_states(job_ids: list[str]) -> dict[str, str] | None:
    """SLURM's state of each job it still knows (array tasks one by one, as ``123_4``); a job missing from the
    answer has left the controller. None where squeue is missing or does not answer."""
    if shutil.which("squeue") is None:
        return None
    arrays = sorted({job_id.split("_")[0] for job_id in job_ids})
    out = subprocess.run(["squeue", "-h", "-r", "-t", "all", "-o", "%i %T", "-j", ",".join(arrays)],
                         capture_output=True, text=True)
    if out.returncode != 0:
        return {} if "Invalid job id" in out.stderr else None     # every job aged out of the controller
    return dict(line.split()[:2] for line in out.stdout.splitlines() if len(line.split()) >= 2)
