"""Which Debian base stands in for a Dockerfile's `FROM` image.

kiln builds Debian roots only (env_base.py), so an image maps to the Debian release closest to it:
Ubuntu by the Debian release it was cut from (C library and compiler of the same age), `python:3.X`
by the release whose python3 is nearest (or the one its tag names), Terminal-Bench's images by what
they are built from. Python images add pip and venv on top, with pip allowed to install system-wide
as it does in those images. Anything else (another registry, an unknown name, Alpine) is refused.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

SUITES = ("bullseye", "bookworm", "trixie")
UBUNTU = {"20.04": "bullseye", "focal": "bullseye", "22.04": "bookworm", "jammy": "bookworm",
          "24.04": "trixie", "noble": "trixie", "24.10": "trixie", "oracular": "trixie", "25.04": "trixie",
          "plucky": "trixie", "latest": "trixie", "rolling": "trixie"}
DEBIAN = {"11": "bullseye", "12": "bookworm", "13": "trixie", "latest": "trixie", "stable": "trixie",
          **{s: s for s in SUITES}}
# python:3.X without a release in its tag: the release whose own python3 is closest to 3.X.
PYTHON = {8: "bullseye", 9: "bullseye", 10: "bookworm", 11: "bookworm"}  # 3.12 and later: trixie
PYTHON_PACKAGES = ("python3-pip", "python3-venv")
PYTHON_ENV = {"PIP_BREAK_SYSTEM_PACKAGES": "1", "LANG": "C.UTF-8"}
BUILDPACK_PACKAGES = ("build-essential", "ca-certificates", "curl", "git", "wget", "procps")
TERMINAL_BENCH = "ghcr.io/laude-institute/t-bench/"
KNOWN = ("ubuntu:*, debian:*, python:3.* (not Alpine), buildpack-deps:*, and Terminal-Bench's "
         f"{TERMINAL_BENCH}ubuntu-* and python-3-* images")


@dataclass(frozen=True)
class BaseImage:
    image: str  # as the Dockerfile names it
    suite: str
    packages: tuple[str, ...] = ()  # apt packages on top of the Debian base (one layer)
    env: dict = field(default_factory=dict)  # the image's own ENV


def _name_tag(image: str) -> tuple[str, str]:
    image = image.split("@")[0]  # a digest pins content kiln cannot reproduce anyway: map by name
    name, _, tag = image.rpartition(":") if ":" in image.rsplit("/", 1)[-1] else (image, "", "latest")
    for prefix in ("docker.io/library/", "docker.io/", "index.docker.io/library/", "library/"):
        name = name.removeprefix(prefix)
    return name, tag or "latest"


def _suite_in(tag: str) -> str | None:
    return next((s for s in SUITES if s in tag.split("-")), None)


def _python(image: str, version: str, tag: str) -> BaseImage | str:
    m = re.match(r"^3(?:\.(\d+))?", version)
    if not m or "alpine" in tag:
        return f"{image}: only Debian-based python:3.* images can be mapped (not {tag!r})"
    minor = int(m.group(1)) if m.group(1) else 13
    suite = _suite_in(tag) or PYTHON.get(minor, "trixie" if minor >= 12 else "bullseye")
    return BaseImage(image, suite, PYTHON_PACKAGES, dict(PYTHON_ENV))


def map_image(image: str) -> BaseImage | str:
    """The Debian base for `image`, or why there is none."""
    name, tag = _name_tag(image)
    if name == "ubuntu":
        suite = UBUNTU.get(tag) or UBUNTU.get(tag.split("-")[0]) or UBUNTU.get(".".join(tag.split(".")[:2]))
        return BaseImage(image, suite) if suite else f"{image}: kiln knows no Debian release close to Ubuntu {tag}"
    if name == "debian":
        suite = DEBIAN.get(tag.split("-")[0].split(".")[0])
        return BaseImage(image, suite) if suite else f"{image}: kiln builds only Debian {', '.join(SUITES)}"
    if name == "python":
        return _python(image, tag.split("-")[0], tag)
    if name == "buildpack-deps":
        suite = _suite_in(tag) or UBUNTU.get(tag.split("-")[0]) or DEBIAN.get(tag.split("-")[0])
        return BaseImage(image, suite, BUILDPACK_PACKAGES) if suite else f"{image}: unknown release {tag!r}"
    if name.startswith(TERMINAL_BENCH):
        kind = name[len(TERMINAL_BENCH):]
        if kind.startswith("ubuntu-"):
            base = map_image("ubuntu:" + kind[len("ubuntu-"):].replace("-", "."))
            return replace(base, image=image) if isinstance(base, BaseImage) else base
        if kind.startswith("python-3-"):
            return _python(image, "3." + kind[len("python-3-"):].split("-")[0], tag)
    return (f"the base image {image!r} is not one kiln can map to a Debian root (it knows {KNOWN}); "
            "a private or other image needs Docker")
