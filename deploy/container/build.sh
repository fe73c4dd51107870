#!/usr/bin/env bash
# Build kvgate's container image with podman (buildah's Containerfile features).
#
#   deploy/container/build.sh                         # FROM docker.io/library/python:3.11-slim
#   deploy/container/build.sh --base my.registry/python:3.11-slim --tag my.registry/kvgate:0.1.0
#   deploy/container/build.sh --local-base kvgate-base:bookworm   # no registry needed
#
# 1. (--local-base TAG) A base image made from Debian's packages: mmdebstrap (minbase,
#    python3, python3-venv) writes a root file system as a tarball, `podman import` makes
#    it an image. Needs root (or mmdebstrap's unshare mode) and Debian's mirrors.
# 2. The wheelhouse, on the host: kvgate's own wheel, and every dependency as a binary wheel
#    for the base image's Python, architecture and C library (asked of the base itself), so
#    the host's Python need not be the image's.
# 3. `podman build` of deploy/container/Containerfile with that wheelhouse as its context:
#    pip installs from it with --no-index, no network inside the build.
#
# Prints the image's tag on its last line. Environment: PYTHON (the host's Python with pip,
# default python3), and what podman reads itself (CONTAINERS_CONF: see
# deploy/container/podman-conf.sh for machines that need one).
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
engine=podman
python="${PYTHON:-python3}"

base="docker.io/library/python:3.11-slim"
local_base=""
suite="bookworm"
mirror=""
deb_cache=""
tag=""
extras=""
wheelhouse=""

usage() {
  awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"
  cat <<'EOF'
Options:
  --base IMAGE         base image with python3 and its venv module (default: python:3.11-slim)
  --local-base TAG     make the base from Debian's packages first, tag it TAG and build on it
  --suite NAME         Debian suite of --local-base (default: bookworm, Python 3.11)
  --mirror URL         Debian mirror of --local-base (default: mmdebstrap's)
  --deb-cache DIR      keep the .deb files of --local-base in DIR and reuse them next time
  --tag TAG            the image's tag (default: localhost/kvgate:<version>)
  --extras LIST        kvgate extras to install, e.g. tokenizers
  --wheelhouse DIR     keep the wheelhouse in DIR (default: a temporary directory)
EOF
}

while [ $# -gt 0 ]; do
  case "$1" in
    --base) base="$2"; shift 2 ;;
    --local-base) local_base="$2"; shift 2 ;;
    --suite) suite="$2"; shift 2 ;;
    --mirror) mirror="$2"; shift 2 ;;
    --deb-cache) deb_cache="$2"; shift 2 ;;
    --tag) tag="$2"; shift 2 ;;
    --extras) extras="$2"; shift 2 ;;
    --wheelhouse) wheelhouse="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "build.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

started=$(date +%s)
say() { echo "build.sh: $* (+$(($(date +%s) - started)) s)" >&2; }

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
wheels="${wheelhouse:-$work/context/wheelhouse}"
mkdir -p "$wheels" "$work/context"
rm -f "$wheels"/kvgate-*.whl

# kvgate's own wheel (pure Python, the same for every base) is built while the base is.
"$python" -m pip wheel --quiet --no-deps --wheel-dir "$wheels" "$root" >"$work/wheel.log" 2>&1 &
wheel_job=$!
trap 'kill "$wheel_job" 2>/dev/null || true; rm -rf "$work"' EXIT

# ---- 1. the local base -----------------------------------------------------------------
if [ -n "$local_base" ]; then
  command -v mmdebstrap >/dev/null || { echo "build.sh: --local-base needs mmdebstrap (apt-get install mmdebstrap)" >&2; exit 1; }
  # minbase is dpkg, apt and the essential set; python3-venv brings ensurepip's wheels.
  # merged-usr: /bin etc. as links into /usr without the usrmerge package (and its perl).
  # Docs, man pages and translations are left out: nobody reads them in a container.
  # The tarball goes straight into `podman import` (TARGET "-" is stdout).
  # --deb-cache: apt's archive directory is filled from DIR before and copied back after
  # (mmdebstrap's sync-in/sync-out hooks), so a second build downloads nothing it has.
  cache=()
  if [ -n "$deb_cache" ]; then
    mkdir -p "$deb_cache"
    deb_cache="$(cd "$deb_cache" && pwd)"
    # shellcheck disable=SC2016  # "$1" is the chroot, expanded by mmdebstrap's shell
    cache=(--skip=essential/unlink
      --setup-hook='mkdir -p "$1"/var/cache/apt/archives/'
      --setup-hook="sync-in $deb_cache /var/cache/apt/archives/"
      --customize-hook="sync-out /var/cache/apt/archives $deb_cache")
  fi
  mmdebstrap --variant=minbase --include=python3,python3-venv "${cache[@]}" \
    --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
    --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    --dpkgopt='path-exclude=/usr/share/info/*' \
    --quiet "$suite" - ${mirror:+"$mirror"} </dev/null 2>"$work/mmdebstrap.log" \
    | "$engine" import --quiet --change 'CMD ["python3"]' - "$local_base" >/dev/null \
    || { cat "$work/mmdebstrap.log" >&2; echo "build.sh: the local base failed" >&2; exit 1; }
  base="$local_base"
  say "base $base built from Debian $suite"
fi

# ---- 2. the wheelhouse -----------------------------------------------------------------
# The base's Python version, machine and glibc decide which binary wheels it can load.
read -r pyver machine glibc < <(
  "$engine" run --rm --network none --entrypoint python3 "$base" -c \
    'import platform, sys; v = sys.version_info; print(f"{v[0]}.{v[1]}", platform.machine(), platform.libc_ver()[1])'
)
[ -n "$glibc" ] || { echo "build.sh: $base has no glibc Python (musl bases are not supported)" >&2; exit 1; }
say "base Python $pyver on $machine, glibc $glibc"
# pip expands none of the manylinux tags given with --platform: name each one the base's
# glibc can load (manylinux_2_5 up to its own), and the legacy aliases.
platforms=()
glibc_minor="${glibc#*.}"
for ((minor = glibc_minor; minor >= 5; minor--)); do
  platforms+=(--platform "manylinux_2_${minor}_${machine}")
done
platforms+=(--platform "manylinux2014_${machine}" --platform "manylinux2010_${machine}" --platform "manylinux1_${machine}")

wait "$wheel_job" || { cat "$work/wheel.log" >&2; echo "build.sh: kvgate's wheel failed" >&2; exit 1; }
kvgate_wheel="$(ls "$wheels"/kvgate-*.whl)"
version="$(basename "$kvgate_wheel" | cut -d- -f2)"
requirement="kvgate${extras:+[$extras]} @ file://$kvgate_wheel"
"$python" -m pip download --quiet --only-binary=:all: --dest "$wheels" \
  --implementation cp --python-version "$pyver" "${platforms[@]}" "$requirement"
# pip evaluates environment markers against the host's Python, not --python-version: a
# dependency only the base needs (async-timeout for redis below Python 3.11.3) is missed.
# So the base checks the wheelhouse itself: a dry-run install inside it, offline, names
# the first requirement the wheelhouse lacks; it is downloaded and the check repeats.
for _ in 1 2 3 4 5 6 7 8; do
  missing="$("$engine" run --rm --network none --volume "$wheels:/wheelhouse:ro" \
    --entrypoint sh "$base" -c 'python3 -m venv /tmp/check >/dev/null 2>&1 \
      && /tmp/check/bin/pip install --dry-run --quiet --no-index --find-links /wheelhouse \
         --disable-pip-version-check "kvgate$0" 2>&1 \
      | sed -n "s/^ERROR: No matching distribution found for \([^;]*\).*$/\1/p"' \
    "${extras:+[$extras]}")"
  [ -n "$missing" ] || break
  say "the base also needs $missing"
  "$python" -m pip download --quiet --only-binary=:all: --dest "$wheels" \
    --implementation cp --python-version "$pyver" "${platforms[@]}" "$missing"
done
[ -z "$missing" ] || { echo "build.sh: the wheelhouse still lacks $missing" >&2; exit 1; }
if [ "$wheels" != "$work/context/wheelhouse" ]; then
  mkdir -p "$work/context/wheelhouse"
  cp "$wheels"/*.whl "$work/context/wheelhouse/"
fi
say "wheelhouse: $(find "$work/context/wheelhouse" -name '*.whl' | wc -l) wheels for kvgate $version"

# ---- 3. the image ----------------------------------------------------------------------
tag="${tag:-localhost/kvgate:$version}"
# docker format keeps the HEALTHCHECK (the OCI format has no such field); --pull=never
# for a base that exists only here (podman would otherwise look for it in a registry).
pull=()
if [ -n "$local_base" ]; then pull=(--pull=never); fi
"$engine" build --quiet --format docker "${pull[@]}" \
  --build-arg "BASE=$base" --build-arg "KVGATE_EXTRAS=$extras" \
  --label "org.opencontainers.image.version=$version" \
  --file "$here/Containerfile" --tag "$tag" "$work/context" >/dev/null
say "image $tag built ($("$engine" image inspect --format '{{.Size}}' "$tag") bytes)"
echo "$tag"
