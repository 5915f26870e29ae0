"""examples/kubernetes/: the manifests validate against Kubernetes' schemas and agree with the pod script, the
image, each other and the kustomization that names their image once; the pod script, signalled as the kubelet
signals a container, checkpoints and exits with the code the Job's podFailurePolicy retries, and exits 0 only
once the run is finished."""
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import yaml

from megalysses.checkpoint.manifest import read_latest, step_of, verify_checkpoint
from tests.faults.launch import ROOT, TINY, env, free_port, gone, kill_all, sets, wait_for_steps, workers_of

EXAMPLE = ROOT / "examples" / "kubernetes"


def manifest(name: str = "pretrain.yaml") -> dict:
    """{kind: resource} of a manifest of examples/kubernetes/."""
    return {doc["kind"]: doc for doc in yaml.safe_load_all((EXAMPLE / name).read_text())}


def _containers(doc: dict) -> list[dict]:
    return doc["spec"]["template"]["spec"]["containers"] if doc["kind"] == "Job" else []


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
    # NCCL's interface and logging, and the capability RDMA's pinned memory needs
    assert {"NCCL_SOCKET_IFNAME", "NCCL_DEBUG", "TORCH_NCCL_ASYNC_ERROR_HANDLING"} <= set(envs)
    assert trainer["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]


def test_the_volumes_outlive_the_jobs_and_the_image_is_named_once():
    """The claims are a manifest of their own (storage), ReadWriteMany, and are what both Jobs mount; the data
    Job builds a dataset on the data volume; kustomization.yaml lists every manifest and sets the image of every
    container; applied by component, storage, then data, then training. Rendered by kubectl where it is
    installed, the whole validates."""
    docs = {name.name: list(yaml.safe_load_all(name.read_text())) for name in sorted(EXAMPLE.glob("*.yaml"))
            if name.name != "kustomization.yaml"}
    claims = {d["metadata"]["name"]: d for d in docs["volumes.yaml"]}
    assert set(claims) == {"megalysses-data", "megalysses-runs"}
    assert all(c["kind"] == "PersistentVolumeClaim" and c["spec"]["accessModes"] == ["ReadWriteMany"]
               for c in claims.values())
    components = {name: {d["metadata"]["labels"]["app.kubernetes.io/component"] for d in ds}
                  for name, ds in docs.items()}
    assert components == {"volumes.yaml": {"storage"}, "load-data.yaml": {"data"}, "pretrain.yaml": {"training"}}
    workdir = re.findall(r"^WORKDIR (\S+)", (ROOT / "Dockerfile").read_text(), re.M)[-1]
    (loader,) = docs["load-data.yaml"]
    (load,) = _containers(loader)
    mounted = {v["name"]: v["persistentVolumeClaim"]["claimName"]
               for v in loader["spec"]["template"]["spec"]["volumes"]}
    assert [(m["mountPath"], mounted[m["name"]]) for m in load["volumeMounts"]] == [(f"{workdir}/data",
                                                                                      "megalysses-data")]
    assert load["command"] == ["make", "corpus"] and "\ncorpus:" in (ROOT / "Makefile").read_text()
    job = manifest()["Job"]
    used = {v["persistentVolumeClaim"]["claimName"] for v in job["spec"]["template"]["spec"]["volumes"]
            if "persistentVolumeClaim" in v}
    assert used == set(claims)
    kustomization = yaml.safe_load((EXAMPLE / "kustomization.yaml").read_text())
    assert kustomization["resources"] == ["volumes.yaml", "load-data.yaml", "pretrain.yaml"] and \
        set(kustomization["resources"]) == set(docs)
    (image,) = kustomization["images"]
    assert {c["image"] for ds in docs.values() for d in ds for c in _containers(d)} == {image["name"]}
    if shutil.which("kubectl") is None:
        return
    rendered = subprocess.run(["kubectl", "kustomize", str(EXAMPLE)], capture_output=True, text=True, timeout=60)
    assert rendered.returncode == 0, rendered.stderr
    objects = list(yaml.safe_load_all(rendered.stdout))
    assert len(objects) == sum(len(ds) for ds in docs.values())
    for resource in objects:
        kubernetes_validate.validate(resource, "1.31.0", strict=True)
        for c in _containers(resource):
            assert c["image"] == f"{image['newName']}:{image['newTag']}"


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
