"""examples/kubernetes/: the manifest validates against Kubernetes' schemas and agrees with the pod script and
the image; the pod script, signalled as the kubelet signals a container, checkpoints and exits with the
code the Job's podFailurePolicy retries, and exits 0 only once the run is finished."""
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import yaml

from megalysses.checkpoint.manifest import read_latest, step_of, verify_checkpoint
from tests.faults.launch import ROOT, TINY, env, free_port, gone, kill_all, sets, wait_for_steps, workers_of

EXAMPLE = ROOT / "examples" / "kubernetes"


def manifest() -> dict:
    """{kind: resource} of pretrain.yaml."""
    return {doc["kind"]: doc for doc in yaml.safe_load_all((EXAMPLE / "pretrain.yaml").read_text())}


def retry_code() -> int:
    """The exit code the Job's podFailurePolicy ignores (restarts the pod without counting a failure)."""
    rules = manifest()["Job"]["spec"]["podFailurePolicy"]["rules"]
    codes = [c for r in rules if r["action"] == "Ignore" and "onExitCodes" in r for c in r["onExitCodes"]["values"]]
    assert len(codes) == 1, codes
    return codes[0]


def test_manifest_validates_and_agrees_with_the_script_and_the_image():
    resources = manifest()
    assert sorted(resources) == ["Job", "Service"]
    for version in ("1.31.0", kubernetes_validate.latest_version()):        # the oldest it needs, the newest
        for resource in resources.values():
            kubernetes_validate.validate(resource, version, strict=True)     # raises ValidationError
    service, job = resources["Service"], resources["Job"]
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    (trainer,) = pod["containers"]
    envs = {e["name"]: e.get("value") for e in trainer["env"]}
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == int(envs["NNODES"])
    assert pod["restartPolicy"] == "Never"                                  # a podFailurePolicy needs it
    # torchrun's rendezvous host is pod 0's name through the headless Service
    assert service["spec"]["clusterIP"] == "None" and pod["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["selector"] == {"batch.kubernetes.io/job-name": job["metadata"]["name"]}
    host, port = envs["RDZV_ENDPOINT"].split(":")
    assert host == f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    assert int(port) == service["spec"]["ports"][0]["port"] == trainer["ports"][0]["containerPort"]
    # the pod runs the script with a config of this repository, in the image's working directory
    assert trainer["command"] == ["bash", "examples/kubernetes/torchrun_pod.sh"]
    assert (ROOT / trainer["args"][0]).is_file()
    script = (EXAMPLE / "torchrun_pod.sh").read_text()
    assert f"RETRY=${{RETRY_EXIT_CODE:-{retry_code()}}}" in script
    workdir = re.findall(r"^WORKDIR (\S+)", (ROOT / "Dockerfile").read_text(), re.M)[-1]
    mounts = {m["mountPath"] for m in trainer["volumeMounts"]}
    assert {f"{workdir}/data", f"{workdir}/runs"} <= mounts
    assert pod["terminationGracePeriodSeconds"] > 30                       # more than the default, for the save


def _pod(run: Path, nproc: int, overrides: list[str], config: Path) -> subprocess.Popen:
    """torchrun_pod.sh as the container runs it, on one CPU node."""
    pod_env = {**env(), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "NNODES": "1",
               "NPROC_PER_NODE": str(nproc), "RDZV_ENDPOINT": f"localhost:{free_port()}", "JOB_COMPLETION_INDEX": "0"}
    return subprocess.Popen(["bash", str(EXAMPLE / "torchrun_pod.sh"), str(config)] + sets(overrides), cwd=ROOT,
                            env=pod_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_sigterm_to_the_pod_checkpoints_and_asks_for_a_restart(tmp_path):
    """The kubelet's SIGTERM reaches the container's first process, the script, alone: the workers (below
    torchrun) save a checkpoint, torchrun exits 0, and the pod exits with the code the Job restarts; on the
    finished run the pod exits 0."""
    run = tmp_path / "run"
    config = tmp_path / "tiny.yaml"
    config.write_text("training:\n  train_steps: 100000\n")
    overrides = TINY + [f"logging.run_dir={run}"]
    p = _pod(run, 2, overrides, config)
    try:
        wait_for_steps(run, p, 2)
        assert len(workers_of(run)) == 2
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=120)
        assert p.returncode == retry_code(), out
        assert "(signal); checkpoint saved" in out and "not finished:" in out, out
        latest, problem = read_latest(run / "checkpoints")
        assert problem is None and verify_checkpoint(latest) == []
        assert gone(run, 5), "a process of the pod was left running"
    finally:
        kill_all(run)
        if p.poll() is None:
            p.kill()
    # the same run with train_steps at the checkpoint's step is finished: pretrain says so, the pod exits 0
    p = _pod(run, 1, overrides + [f"training.train_steps={step_of(latest)}"], config)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 0, out
    assert "this run already finished" in out and "finished: " in out, out
