"""deploy/docker: no Docker engine runs here, so the Dockerfile is linted: every FROM pinned
to a version, no ADD (of URLs or at all), every image stage ends as a non-root USER, the build
stage uses the repository's own scripts/setup.sh and `bazel build -c opt`, the CUDA images sit
on nvidia/cuda, and each image's entrypoint and ports match the binaries and the manifests."""
import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import deploy_testlib as lib

DOCKERFILE = os.path.join(lib.deploy_dir(), "docker", "Dockerfile")
DOCKERIGNORE = DOCKERFILE + ".dockerignore"
IMAGES = {  # target: (binary, ports)
    "planner": ("hap-planner", {7070, 9464}),
    "agent": ("hap-agent", {7071}),
    "executor": ("hap-executor", {7100}),
    "agent-cuda": ("hap-agent", {7071}),
    "executor-cuda": ("hap-executor", {7100}),
}


def instructions(text):
    """(keyword, arguments) per instruction: continuation lines joined, comments dropped."""
    out, cur = [], ""
    for line in text.splitlines():
        if re.match(r"\s*#", line):
            continue
        cur += line.rstrip("\\").rstrip() + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            if cur.strip():
                kw, _, args = cur.strip().partition(" ")
                out.append((kw.upper(), args.strip()))
            cur = ""
    return out


def runtime_packages_work(build_runs):
    """Runs the build stage's lookup of the Debian packages the binaries link (the part of its
    RUN from `for f in` to /out/runtime-packages) on the binaries built here, as Docker would
    (this machine is Debian 12, as the build stage): it must succeed and name the packages of
    libraries we know the binaries link."""
    cmd = next((r for r in build_runs if "/out/runtime-packages" in r), "")
    start, end = cmd.find("for f in"), cmd.find("/out/runtime-packages")
    if start < 0 or end < 0:
        return ["build stage: no `for f in ...` lookup writing /out/runtime-packages"]
    if not shutil.which("dpkg"):
        lib.skip("'dpkg' is not installed (the package lookup runs on Debian)")
    with tempfile.TemporaryDirectory() as tmp:
        os.makedirs(os.path.join(tmp, "bin"))
        for env in ("HAP_PLANNER_BIN", "HAP_AGENT_BIN", "HAP_EXECUTOR_BIN", "HAPCTL_BIN"):
            path = lib.binary(env)
            os.symlink(path, os.path.join(tmp, "bin", os.path.basename(path)))
        script = (cmd[start:end] + "/out/runtime-packages").replace("/out/", tmp + "/") \
            .replace("/tmp/owners", os.path.join(tmp, "owners"))
        # Built here under --config=cuda (scripts/test.sh where nvcc is), the binaries also
        # link the CUDA toolkit's libraries, which no Debian package owns; the build stage's
        # binaries, built without it, link none (the -cuda images take them from NVIDIA's).
        sort = "| sort -u)"
        if sort not in script:
            return ["build stage: the lookup's library list no longer ends in `| sort -u)`"]
        script = script.replace(sort, "| grep -v '^/usr/local/cuda' " + sort, 1)
        out = subprocess.run(["sh", "-c", script], capture_output=True, text=True)
        if out.returncode != 0:
            return [f"the runtime package lookup fails here: {out.stderr.strip()}"]
        packages = set(open(os.path.join(tmp, "runtime-packages")).read().split())
    print(f"runtime packages: {' '.join(sorted(packages))}")
    # Libraries the binaries link, one shipped under /usr/lib and one under /lib.
    missing = {"libsqlite3-0", "libgrpc++1.51", "zlib1g"} - packages
    return [f"the runtime package lookup misses {sorted(missing)}"] if missing else []


def manifest_images():
    """{target: the image the manifests run it as}: the base's container images, and for a
    -cuda target the gpu overlay's tag of that image."""
    import yaml
    k8s = os.path.join(lib.deploy_dir(), "k8s")
    base = {}
    for name in os.listdir(os.path.join(k8s, "base")):
        for doc in yaml.safe_load_all(open(os.path.join(k8s, "base", name))):
            pod = (doc or {}).get("spec", {}).get("template", {}).get("spec", {})
            for c in pod.get("containers", []):
                base[c["name"]] = c["image"]
    gpu = yaml.safe_load(open(os.path.join(k8s, "overlays", "gpu", "kustomization.yaml")))
    tags = {i["name"]: i["newTag"] for i in gpu.get("images", []) if "newTag" in i}
    out = {}
    for target in IMAGES:
        image = base.get(target.removesuffix("-cuda"))
        if image and target.endswith("-cuda"):
            name = image.rpartition(":")[0]
            image = f"{name}:{tags[name]}" if name in tags else None
        out[target] = image
    return out


def build_tags():
    """(where, target, tag) of every `docker build ... --target T -t TAG` this folder shows:
    the Dockerfile's header and deploy/README.md."""
    out = []
    for path in (DOCKERFILE, os.path.join(lib.deploy_dir(), "README.md")):
        for line in open(path):
            m = re.search(r"docker build .*--target\s+(\S+)\s+-t\s+(\S+)", line)
            if m:
                out.append((os.path.relpath(path, lib.deploy_dir()), m.group(1), m.group(2)))
    return out


def main():
    failures = []
    lines = open(DOCKERFILE).read().splitlines()
    for i, line in enumerate(lines[:-1]):
        # Docker skips the blank line and joins the next instruction into this one.
        if line.endswith("\\") and not lines[i + 1].strip():
            failures.append(f"line {i + 1}: continued into a blank line")
    stages, current = {}, None
    for kw, args in instructions(open(DOCKERFILE).read()):
        if kw == "FROM":
            m = re.match(r"(\S+)\s+AS\s+(\S+)$", args, re.I)
            if not m:
                failures.append(f"FROM {args}: every stage is named (FROM image AS name)")
                continue
            image, current = m.group(1), m.group(2)
            stages[current] = {"from": image, "user": None, "run": [], "entrypoint": None,
                               "expose": set(), "copy": []}
            if image not in stages:
                name, _, tag = image.partition(":")
                if "@sha256:" not in image and (not tag or tag == "latest" or
                                                not re.search(r"\d", tag)):
                    failures.append(f"FROM {image}: not pinned to a version")
        elif current is None:
            failures.append(f"{kw} before the first FROM")
        elif kw == "ADD":
            failures.append(f"ADD {args}: use COPY (and never ADD a URL)")
        elif kw == "USER":
            stages[current]["user"] = args
        elif kw == "RUN":
            stages[current]["run"].append(args)
        elif kw == "ENTRYPOINT":
            stages[current]["entrypoint"] = json.loads(args)
        elif kw == "EXPOSE":
            stages[current]["expose"] |= {int(p.split("/")[0]) for p in args.split()}
        elif kw == "COPY":
            stages[current]["copy"].append(args)

    def inherited(stage, key):
        while stage in stages:
            if stages[stage][key]:
                return stages[stage][key]
            stage = stages[stage]["from"]
        return None

    build = stages.get("build")
    if not build:
        failures.append("no build stage")
    else:
        runs = " ".join(build["run"])
        if not build["from"].startswith("debian:12"):
            failures.append(f"build stage is {build['from']}, not Debian 12")
        if "scripts/setup.sh" not in runs:
            failures.append("build stage does not run scripts/setup.sh")
        if not re.search(r"bazel build -c opt", runs):
            failures.append("build stage does not run bazel build -c opt")
    for target, (binary, ports) in IMAGES.items():
        s = stages.get(target)
        if not s:
            failures.append(f"no image target {target}")
            continue
        user = inherited(target, "user")
        if not user or user.split(":")[0] in ("root", "0"):
            failures.append(f"{target}: USER {user!r} is not a non-root user")
        entry = s["entrypoint"] or []
        if not entry or os.path.basename(entry[0]) != binary:
            failures.append(f"{target}: entrypoint {entry} does not run {binary}")
        if binary == "hap-executor" and "--serve" not in entry:
            failures.append(f"{target}: the executor image must run the daemon (--serve)")
        if s["expose"] != ports:
            failures.append(f"{target}: EXPOSE {s['expose']} != {ports}")
        base = target
        while base in stages:
            root = stages[base]["from"]
            base = root
        if target.endswith("-cuda") != root.startswith("nvidia/cuda:"):
            failures.append(f"{target}: base image {root}")
        if target in ("planner", "agent", "executor") and not root.startswith("debian:12"):
            failures.append(f"{target}: runtime base {root} is not Debian 12")
    # Each image's binaries (and the CUDA images' libraries) come from a build with CUDA
    # for the -cuda images and without for the others: a -cuda agent built without
    # --config=cuda has no GPU prober and reports NODE/cpu0, which no GPU executor serves.
    def chain(stage):
        """stage and the stages it is built on, nearest first."""
        out = []
        while stage in stages:
            out.append(stage)
            stage = stages[stage]["from"]
        return out

    def runs(stage):
        return [r for st in chain(stage) for r in stages[st]["run"]]

    for target in IMAGES:
        if target not in stages:
            continue
        copies = [c for st in chain(target) for c in stages[st]["copy"]]
        sources = {m.group(1) for c in copies
                   for m in [re.match(r"--from=(\S+)\s+/out/", c)] if m}
        if not sources:
            failures.append(f"{target}: copies nothing from a build stage's /out")
        for src in sources:
            cmds = [r for r in runs(src) if "bazel build" in r]
            cuda = any("--config=cuda" in c for c in cmds)
            if not cmds:
                failures.append(f"{target}: COPY --from={src}, a stage that runs no bazel build")
            elif target.endswith("-cuda") and not cuda:
                failures.append(f"{target}: its files come from {src}, built without "
                                f"--config=cuda (no GPU prober, no CUDA executor)")
            elif not target.endswith("-cuda") and cuda:
                failures.append(f"{target}: its files come from {src}, a CUDA build")
            elif not any("scripts/setup.sh" in r for r in runs(src)):
                failures.append(f"{target}: its build stage {src} is not on scripts/setup.sh")

    # The build context is the repository: what git ignores there (outputs, local settings,
    # GPU bundles, checkpoints) stays out of it.
    repo = os.path.dirname(lib.deploy_dir())
    ignored = [l.strip().strip("/") for l in open(os.path.join(repo, ".gitignore"))
               if l.strip() and not l.startswith("#")]
    docker_ignored = {l.strip().strip("/").removeprefix("**/") for l in open(DOCKERIGNORE)
                      if l.strip() and not l.startswith("#")}
    for path in ignored:
        if path.rstrip("/").removeprefix("**/") not in docker_ignored and not any(
                fnmatch.fnmatch(path.rstrip("/"), d) for d in docker_ignored):
            failures.append(f"{path}: ignored by git but not by {os.path.basename(DOCKERIGNORE)}")

    # The tags the build commands give are the images the manifests pull: a build tagged
    # otherwise leaves every pod in ErrImagePull (or on an older image of that name).
    images = manifest_images()
    tags = build_tags()
    for target in IMAGES:
        if not any(t == target for _, t, _ in tags):
            failures.append(f"no `docker build --target {target} -t ...` line in the Dockerfile "
                            f"or deploy/README.md")
    for where, target, tag in tags:
        if target in images and tag != images[target]:
            failures.append(f"{where}: --target {target} is tagged {tag}, but the manifests run "
                            f"it as {images[target]}")
    failures += runtime_packages_work(stages.get("build", {}).get("run", []))

    if failures:
        print("\n".join("FAIL: " + f for f in failures))
        sys.exit(1)
    print(f"{len(stages)} stages: " + ", ".join(f"{k} <- {v['from']}" for k, v in stages.items()))
    print("PASS")


if __name__ == "__main__":
    main()
