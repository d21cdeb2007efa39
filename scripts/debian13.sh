#!/usr/bin/env bash
# The LibTorch 2.x legs: builds this checkout and runs its suite in a Debian 13
# (trixie) chroot, against Debian 13's LibTorch 2.6.
#
#   bash scripts/debian13.sh cpu  [COMMAND...]   # libtorch-dev 2.6 (CPU, Gloo)
#   bash scripts/debian13.sh cuda [COMMAND...]   # libtorch-cuda-dev 2.6, CUDA 12.4, NCCL 2.22 (no GPU needed)
#
# CI runs in the cuda leg the build and the tests whose outcome a CUDA
# LibTorch can change on a machine without a GPU, and in the cpu leg the
# rest of the suite, so that each test meets LibTorch 2.6 once:
#   bash scripts/debian13.sh cuda bash scripts/test.sh -L 'unit|cuda|scripts|package'
#   bash scripts/debian13.sh cpu bash scripts/test.sh -LE 'slow|unit|cuda|scripts|package'
#
# COMMAND (default: bash scripts/test.sh) runs as root in a copy of the
# checkout at /root/mnist_ddp inside the chroot; its build/ is kept between
# runs, so a second run rebuilds only what changed. The chroot lives at
# $MNIST_DDP_CHROOT_DIR/debian13-<leg> (default /var/cache/mnist_ddp): made
# once with debootstrap from the mirror this machine's apt uses, its packages
# installed when missing. The chroot itself (bound onto itself, so that its /
# is a mount point, as `ip netns exec` needs), /proc, /dev, /dev/pts and
# /dev/shm are mounted for the run and unmounted when it ends, however it
# ends, with whatever the tests mounted inside (a network namespace's).
#
# The cuda leg proves that the NCCL path compiles and links against a CUDA
# LibTorch 2.x and that the CPU behaviour is right there; it runs no GPU.
# Debian's nvidia-cudnn only downloads cuDNN from outside, so the leg stands
# in a placeholder package for it and a libcudnn.so.9 whose functions abort:
# LibTorch links and loads, and nothing here calls cuDNN.
set -euo pipefail

leg="${1:-}"
case "$leg" in
  cpu | cuda) shift ;;
  *) echo "usage: bash scripts/debian13.sh cpu|cuda [COMMAND...]" >&2; exit 2 ;;
esac
[ "$(id -u)" -eq 0 ] || { echo "debian13.sh: needs root (debootstrap, chroot, mounts)" >&2; exit 2; }
here="$(cd "$(dirname "$0")/.." && pwd)"
root="${MNIST_DDP_CHROOT_DIR:-/var/cache/mnist_ddp}/debian13-$leg"
[ "$#" -gt 0 ] || set -- bash scripts/test.sh

say() { echo "debian13.sh [$leg]: $*"; }

# The Debian mirror this machine's apt uses (a proxy or local mirror
# included): we name none of our own.
mirror() {
  local uri
  uri="$(grep -hsE '^(URIs:|deb )' /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null |
         grep -oE 'https?://[^ ]+/debian/?' | grep -v security | head -n 1)" || true
  [ -n "$uri" ] || { echo "debian13.sh: no Debian mirror (http://.../debian) in this machine's apt sources to make the chroot from: add one to /etc/apt/sources.list.d/" >&2; exit 1; }
  echo "$uri"
}

if [ ! -x "$root/usr/bin/apt-get" ]; then
  command -v debootstrap >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null; }
  uri="$(mirror)"
  say "making a Debian 13 chroot in $root from $uri"
  rm -rf "$root.partial"
  mkdir -p "$(dirname "$root")"
  debootstrap --variant=minbase --components=main,contrib,non-free trixie "$root.partial" "$uri" >/dev/null
  mv "$root.partial" "$root"
fi

# Mounts for the run, undone on any exit. Each one is recorded as it is made,
# so only what this run mounted is unmounted.
mounted=()
cleanup() {
  local i
  for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do umount -l "${mounted[i]}" 2>/dev/null || true; done
}
trap cleanup EXIT
mount_in() {  # mount_in TARGET ARGS...
  local target="$root$1"; shift
  mountpoint -q "$target" && return 0
  mkdir -p "$target"
  mount "$@" "$target"
  mounted+=("$target")
}
mount_in "" --bind "$root"
mount_in /proc -t proc proc
mount_in /dev --bind /dev
mount_in /dev/pts --bind /dev/pts
mount_in /dev/shm -t tmpfs -o mode=1777 shm
cp /etc/resolv.conf /etc/hosts "$root/etc/" 2>/dev/null || true  # this machine's names resolve alike there
in_root() { chroot "$root" /usr/bin/env -i HOME=/root PATH=/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 CI="${CI:-}" "$@"; }

installed() { in_root dpkg-query -W -f='${Status}\n' "$@" 2>/dev/null | grep -c " ok installed" || true; }
apt_install() {
  in_root apt-get update -qq
  in_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

if [ "$leg" = cuda ]; then
  # The CUDA LibTorch, before scripts/install_deps.sh sees the chroot: that
  # script then keeps it and picks the Gloo and Python packages that go with it.
  if [ "$(installed nvidia-cudnn)" != 1 ]; then
    say "a placeholder nvidia-cudnn package (Debian's only downloads cuDNN)"
    pkg="$root/tmp/nvidia-cudnn"
    rm -rf "$pkg" && mkdir -p "$pkg/DEBIAN"
    printf '%s\n' "Package: nvidia-cudnn" "Version: 9.99~placeholder" "Architecture: amd64" \
      "Maintainer: mnist_ddp <ci@localhost>" "Description: placeholder for the mnist_ddp CUDA build leg" >"$pkg/DEBIAN/control"
    in_root dpkg-deb --build /tmp/nvidia-cudnn /tmp/nvidia-cudnn.deb >/dev/null
    in_root dpkg -i /tmp/nvidia-cudnn.deb >/dev/null
    in_root apt-mark hold nvidia-cudnn >/dev/null
  fi
  cuda_packages=(libtorch-cuda-dev python3-torch-cuda libnccl-dev nvidia-cuda-toolkit g++ binutils)
  if [ "$(installed "${cuda_packages[@]}")" != "${#cuda_packages[@]}" ]; then
    say "installing ${cuda_packages[*]}"
    apt_install "${cuda_packages[@]}"
  fi
  # Made afresh each run (a second or two): every cudnn function that
  # LibTorch's libraries and its Python module ask for.
  in_root sh -c "nm -D --undefined-only /usr/lib/x86_64-linux-gnu/libtorch*.so* 2>/dev/null |
    awk '\$2 ~ /^cudnn/ {sub(/@.*/, \"\", \$2); print \$2}' | sort -u" >"$root/tmp/cudnn.syms"
  if ! cmp -s "$root/tmp/cudnn.syms" "$root/tmp/cudnn.built" || [ ! -e "$root/usr/lib/x86_64-linux-gnu/libcudnn.so.9" ]; then
    say "a libcudnn.so.9 whose every function aborts (LibTorch links it; nothing here calls it)"
    [ -s "$root/tmp/cudnn.syms" ] || { say "found no cudnn symbols in LibTorch's libraries"; exit 1; }
    {
      echo '#include <stdlib.h>'
      while read -r s; do echo "void $s(void) { abort(); }"; done <"$root/tmp/cudnn.syms"
    } >"$root/tmp/cudnn_stub.c"
    printf 'libcudnn.so.9 { global: *; };\n' >"$root/tmp/cudnn.map"
    in_root gcc -shared -fPIC -o /usr/lib/x86_64-linux-gnu/libcudnn.so.9 /tmp/cudnn_stub.c \
      -Wl,-soname,libcudnn.so.9 -Wl,--version-script=/tmp/cudnn.map
    in_root ln -sf libcudnn.so.9 /usr/lib/x86_64-linux-gnu/libcudnn.so
    cp "$root/tmp/cudnn.syms" "$root/tmp/cudnn.built"
  fi
fi

# A copy of the checkout, tracked and untracked files as git sees them, and
# the data already fetched; build/ stays from the last run. Each file is
# stamped with the time of this copy unless the last copy held it unchanged,
# which keeps its stamp: a file edited after the last copy but before its
# build ended would otherwise look older than its objects, and the build
# would link stale ones.
dest="$root/root/mnist_ddp" stage="$root/root/mnist_ddp.copy"
rm -rf "$stage"
mkdir -p "$dest" "$stage"
(cd "$here" && { git ls-files -z --cached --others --exclude-standard; find data -type f -print0 2>/dev/null; } |
  tar --null --no-recursion --ignore-failed-read -cf - -T -) | tar -xmf - -C "$stage"
(cd "$stage" && find . -type f -print0) | while IFS= read -r -d '' f; do
  if cmp -s "$stage/$f" "$dest/$f"; then touch -r "$dest/$f" "$stage/$f"; fi
done
find "$dest" -mindepth 1 -maxdepth 1 ! -name build -exec rm -rf {} +
(cd "$stage" && tar -cf - .) | tar -xf - -C "$dest"
rm -rf "$stage"

say "running: $*"
start=$(date +%s)
in_root bash -c 'cd /root/mnist_ddp && "$@"' bash "$@" 2>&1 | tee "$root/tmp/leg.log"
if [[ "$*" == "bash scripts/test.sh"* ]]; then
  # What the leg proves beyond the suite: the project's own code compiles
  # without a warning, and the cuda leg builds the CUDA/NCCL path.
  if grep -E '^/root/mnist_ddp/(src|include|app|tests|examples)/.*warning:' "$root/tmp/leg.log"; then
    say "the project's code compiles with warnings against this LibTorch"
    exit 1
  fi
  want="CUDA/NCCL path: OFF"
  [ "$leg" = cuda ] && want="CUDA/NCCL path: ON"
  grep -q "mnist_ddp: LibTorch .*, $want" "$root/tmp/leg.log" || { say "configure did not say '$want'"; exit 1; }
fi
say "passed in $(( $(date +%s) - start )) s"
