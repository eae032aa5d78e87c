#!/usr/bin/env bash
# Prepares this machine for the sandbox backends, where it allows: installs bubblewrap and the
# Docker engine when missing, starts dockerd if none runs, and builds two local images (no
# registry: each is a rootfs made of this host's own Debian packages, loaded with `docker
# import`):
#   ptrain-sandbox:latest    python3, bash, coreutils, gzip and tar: the docker backend's image
#   ptrain-term-base:latest  the base of terminal tasks (sandbox/terminal/tasks/, sandbox/terminal/):
#                            bash, coreutils, gzip/tar/xz/bzip2/zip, procps, python3, jq, ...
#                            (no curl or wget: there is no network to fetch from)
# and, where bwrap is installed, the same rootfs as ptrain-term-base unpacked in a directory
# for the terminal tasks' bubblewrap backend (no docker needed for that one):
#   $PTRAIN_TERM_ROOTFS_DIR/ptrain-term-base/  (default /var/lib/ptrain/rootfs), with
#   ptrain-term-base.json beside it (the image's name, PATH, LANG and WORKDIR)
# and, for CAD runs (sandbox/cad/), a venv of Debian's python3 with CadQuery at
# $PTRAIN_CAD_VENV (default /opt/ptrain/cad) and the image ptrain-cad:latest that holds it.
#
# Idempotent and quick when all is there; never fails (a backend that cannot run is skipped
# by the tests, with the reason). Called by `make test` as `bash sandbox/setup_host.sh`.
set -u
IMAGE="${PTRAIN_SANDBOX_IMAGE:-ptrain-sandbox:latest}"
PYTHON_ROOTS="python3.11-minimal python3.11 libpython3.11-stdlib python3-minimal python3"
# gzip and tar: what a bash tool call in the docker backend most often reaches for.
SANDBOX_ROOTS="bash dash coreutils grep sed findutils diffutils gzip tar $PYTHON_ROOTS"
TERM_IMAGE="${PTRAIN_TERM_BASE_IMAGE:-ptrain-term-base:latest}"
ROOTFS_DIR="${PTRAIN_TERM_ROOTFS_DIR:-/var/lib/ptrain/rootfs}"
TERM_ROOTS="$SANDBOX_ROOTS xz-utils bzip2 zip unzip procps psmisc patch bc jq mawk"
TERM_ROOTS="$TERM_ROOTS file sqlite3 make less debianutils"
# CAD runs (sandbox/cad/): CadQuery and the meshing packages in a venv of Debian's python3 that
# the sandbox's unprivileged uid can read (bound read-only into bwrap; copied into the docker
# image ptrain-cad), and the shared libraries OCP and VTK link to.
CAD_VENV="${PTRAIN_CAD_VENV:-/opt/ptrain/cad}"
CAD_IMAGE="${PTRAIN_CAD_IMAGE:-ptrain-cad:latest}"
CAD_PACKAGES="cadquery==2.8.0 cadquery-ocp==7.9.3.1.1 trimesh==5.2.0 manifold3d==3.5.4 scipy"
CAD_ROOTS="$SANDBOX_ROOTS libgl1 libx11-6 libexpat1"
say() { echo "setup_host: $*"; }

install_packages() {
  local missing=()
  command -v bwrap >/dev/null || missing+=(bubblewrap)
  command -v dockerd >/dev/null || missing+=(docker.io)
  # Not a sandbox backend: the allocator tests/conftest.py preloads into the test processes
  # (XLA's compiles cost ~10% less CPU with it than with glibc's malloc).
  ldconfig -p 2>/dev/null | grep -q 'libjemalloc\.so\.2' || missing+=(libjemalloc2)
  # Not a sandbox backend either: the headless browser tests/test_report.py renders the run
  # report (report.html) in.
  command -v chromium >/dev/null || missing+=(chromium)
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    say "not root or no apt-get: cannot install ${missing[*]}"
    return 0
  fi
  say "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q --no-install-recommends "${missing[@]}" >/tmp/ptrain-apt.log 2>&1 || {
    apt-get update -q >>/tmp/ptrain-apt.log 2>&1
    apt-get install -y -q --no-install-recommends "${missing[@]}" >>/tmp/ptrain-apt.log 2>&1
  } || say "apt-get failed (see /tmp/ptrain-apt.log)"
}

start_dockerd() {
  command -v dockerd >/dev/null || return 1
  docker info >/dev/null 2>&1 && return 0
  if [ "$(id -u)" != 0 ]; then
    say "dockerd is not running and we are not root to start it"
    return 1
  fi
  say "starting dockerd"
  # No bridge and no iptables: sandboxes use network none (or the host's, when asked).
  nohup setsid dockerd --iptables=false --ip6tables=false --bridge=none \
    >/var/log/ptrain-dockerd.log 2>&1 </dev/null &
  for _ in $(seq 1 150); do
    docker info >/dev/null 2>&1 && return 0
    sleep 0.2
  done
  say "dockerd did not come up (see /var/log/ptrain-dockerd.log)"
  return 1
}

# The packages $1 (a list of roots) need, first alternative of each dependency, as installed here.
package_closure() {
  local -A seen=()
  local queue=($1) pkg deps dep
  while [ ${#queue[@]} -gt 0 ]; do
    pkg="${queue[0]}"
    queue=("${queue[@]:1}")
    [ -n "${seen[$pkg]:-}" ] && continue
    dpkg-query -W -f='${db:Status-Status}' "$pkg" 2>/dev/null | grep -qx installed || continue
    seen[$pkg]=1
    deps=$(dpkg-query -W -f='${Pre-Depends},${Depends}' "$pkg")
    while IFS= read -r dep; do
      dep="${dep%%|*}"
      dep="${dep%%(*}"
      dep="${dep%%:*}"
      dep="${dep// /}"
      [ -n "$dep" ] && queue+=("$dep")
    done < <(tr ',' '\n' <<<"$deps")
  done
  printf '%s\n' "${!seen[@]}" | sort
}

# The CAD venv: rebuilt when CAD_PACKAGES change (its marker file), left alone otherwise.
build_cad_venv() {
  [ "${PTRAIN_SETUP_CAD:-1}" = 1 ] || return 1
  [ -x /usr/bin/python3 ] || { say "no /usr/bin/python3: no CAD venv"; return 1; }
  grep -qsxF "$CAD_PACKAGES" "$CAD_VENV/ptrain-packages" && return 0
  say "building the CAD venv in $CAD_VENV ($CAD_PACKAGES)"
  # (a venv finds its packages from where its bin/python is: it can be built aside and moved)
  rm -rf "$CAD_VENV.new" && mkdir -p "$(dirname "$CAD_VENV")" \
    && /usr/bin/python3 -m venv "$CAD_VENV.new" \
    && "$CAD_VENV.new/bin/python" -m pip install -q --no-cache-dir $CAD_PACKAGES \
      >/tmp/ptrain-cad-venv.log 2>&1 \
    && "$CAD_VENV.new/bin/python" -I -c 'import cadquery, trimesh, manifold3d, scipy.spatial' \
    && chmod -R a+rX "$CAD_VENV.new" && echo "$CAD_PACKAGES" >"$CAD_VENV.new/ptrain-packages" \
    && rm -rf "$CAD_VENV" && mv "$CAD_VENV.new" "$CAD_VENV" && say "built the CAD venv" \
    || { say "could not build the CAD venv (see /tmp/ptrain-cad-venv.log)"
         rm -rf "$CAD_VENV.new"; return 1; }
}

# build_image IMAGE ROOTS WORKDIR [DIR:MODE ...]: a rootfs of ROOTS' package closure, tagged
# IMAGE once it runs python3 and bash (where docker runs), and unpacked for bwrap in
# $ROOTFS_DIR (where bwrap is installed and PTRAIN_ROOTFS=1: the terminal base only);
# rebuilt only when its packages or this script change (the hash label). Each DIR is created
# with MODE (docker copies the modes of /work and /tmp onto the tmpfs mounts there).
build_image() {
  local image="$1" roots="$2" workdir="$3"
  shift 3
  command -v dpkg-query >/dev/null || { say "no dpkg: cannot build $image"; return 1; }
  local pkgs hash have want_docker=0 want_rootfs=0 rootfs_name="${image%%:*}"
  pkgs=$(package_closure "$roots")
  hash=$( (dpkg-query -W $pkgs; sha256sum "$0"; echo "$image $workdir $* ${EXTRA_TREE:-}";
          [ -n "${EXTRA_TREE:-}" ] && cat "$EXTRA_TREE/ptrain-packages") | sha256sum | cut -c1-16)
  if [ "$DOCKER_OK" = 1 ]; then
    have=$(docker image inspect -f '{{index .Config.Labels "ptrain.hash"}}' "$image" 2>/dev/null)
    [ "$have" = "$hash" ] || want_docker=1
  fi
  if [ "${PTRAIN_ROOTFS:-0}" = 1 ] && command -v bwrap >/dev/null; then
    grep -qs "\"hash\": \"$hash\"" "$ROOTFS_DIR/$rootfs_name.json" || want_rootfs=1
  fi
  [ $want_docker = 0 ] && [ $want_rootfs = 0 ] && return 0
  say "building $image from $(wc -w <<<"$pkgs") host packages"
  local tmp old spec dirs=()
  old=$(docker image inspect -f '{{.Id}}' "$image" 2>/dev/null)
  tmp=$(mktemp -d)
  mkdir -p "$tmp/etc" "$tmp/root"
  for spec in "$@"; do
    mkdir -p "$tmp/${spec%%:*}"
    chmod "${spec##*:}" "$tmp/${spec%%:*}"
    dirs+=("${spec%%:*}")
  done
  chmod 700 "$tmp/root"
  printf 'root:x:0:0:root:/root:/bin/bash\nnobody:x:65534:65534::/nonexistent:/bin/false\n' \
    >"$tmp/etc/passwd"
  printf 'root:x:0:\nnogroup:x:65534:\n' >"$tmp/etc/group"
  for link in bin sbin lib lib64; do
    [ -L "/$link" ] && ln -s "$(readlink "/$link")" "$tmp/$link"
  done
  # Every file of every package, minus docs, with merged-/usr prefixes (/bin -> usr/bin)
  # rewritten to where the files really are.
  local rewrite=()
  for link in bin sbin lib lib64; do
    [ -L "/$link" ] && rewrite+=(-e "s#^/$link/#/$(readlink "/$link")/#")
  done
  dpkg -L $pkgs 2>/dev/null | grep -v -e '^/usr/share/doc' -e '^/usr/share/man' \
    -e '^/usr/share/locale' -e '^/usr/share/info' -e '/__pycache__' -e '/test/' \
    | sed "${rewrite[@]}" -e 's#^/usr/usr/#/usr/#' | sort -u \
    | while IFS= read -r path; do
        [ -d "$path" ] && [ ! -L "$path" ] && continue
        [ "$(dirname "$path")" = / ] && continue  # /bin and friends: added below
        [ -e "$path" ] || [ -L "$path" ] && echo "$path"
      done >"$tmp/files"
  # Byte code: Debian compiles it at install time, so dpkg does not list it; without it every
  # import in the (read-only) container would compile from source.
  find /usr/lib/python3.11 -name '*.pyc' -not -path '*/test/*' >>"$tmp/files" 2>/dev/null
  echo /etc/ld.so.cache >>"$tmp/files"
  # Alternatives (awk -> mawk): the master link and /etc/alternatives/NAME, where the image
  # has the file they point to (dpkg does not list them: update-alternatives makes them).
  local alt name link target
  for alt in /var/lib/dpkg/alternatives/*; do
    name=$(basename "$alt")
    link=$(sed -n 2p "$alt")
    target=$(readlink "/etc/alternatives/$name")
    if [ -n "$target" ] && [ -L "$link" ] && grep -qxF "$target" "$tmp/files"; then
      printf '%s\n' "$link" "/etc/alternatives/$name" >>"$tmp/files"
    fi
  done
  tar -C / -cf "$tmp/rootfs.tar" --no-recursion -T "$tmp/files" 2>/dev/null
  tar -C "$tmp" -rf "$tmp/rootfs.tar" etc/passwd etc/group root "${dirs[@]}" \
    $(cd "$tmp" && ls -d bin sbin lib lib64 2>/dev/null)
  # EXTRA_TREE: a host directory copied whole (the CAD venv)
  [ -n "${EXTRA_TREE:-}" ] && tar -C / -rf "$tmp/rootfs.tar" "${EXTRA_TREE#/}"
  if [ $want_rootfs = 1 ]; then  # the same files, unpacked for bwrap (checked the same way)
    local dest="$ROOTFS_DIR/$rootfs_name"
    mkdir -p "$ROOTFS_DIR" && rm -rf "$dest.new" && mkdir "$dest.new" \
      && tar -C "$dest.new" -xpf "$tmp/rootfs.tar" && mkdir -p "$dest.new/proc" "$dest.new/dev" \
      && bwrap --unshare-all --die-with-parent --ro-bind "$dest.new" / --proc /proc \
        --dev /dev /usr/bin/python3 -I -c \
        'import json, unittest, subprocess; subprocess.run(["bash", "-c", "ls /"], check=True)' \
        >/dev/null \
      && rm -rf "$dest" && mv "$dest.new" "$dest" \
      && printf '{"image": "%s", "hash": "%s", "workdir": "%s", "env": {"PATH": %s, "LANG": %s}}\n' \
        "$image" "$hash" "$workdir" '"/usr/local/bin:/usr/bin:/bin"' '"C.UTF-8"' \
        >"$ROOTFS_DIR/$rootfs_name.json" \
      && say "unpacked $image for bwrap in $dest" || say "could not unpack $image for bwrap"
    rm -rf "$dest.new"
  fi
  if [ $want_docker = 1 ]; then
    docker import -c "LABEL ptrain.hash=$hash" -c 'ENV PATH=/usr/local/bin:/usr/bin:/bin' \
      -c 'ENV LANG=C.UTF-8' -c "WORKDIR $workdir" "$tmp/rootfs.tar" "$image-candidate" \
      >/dev/null \
      && docker run --rm --network none "$image-candidate" /usr/bin/python3 -I -c \
        'import json, unittest, subprocess; subprocess.run(["bash", "-c", "ls /"], check=True)' \
        >/dev/null \
      && docker tag "$image-candidate" "$image" && say "built $image" || say "could not build $image"
    docker rmi "$image-candidate" >/dev/null 2>&1
    [ -n "$old" ] && docker rmi "$old" >/dev/null 2>&1  # the build this one replaces
  fi
  rm -rf "$tmp"
}

install_packages
DOCKER_OK=0  # PTRAIN_SETUP_DOCKER=0: leave docker and its images alone (the bwrap rootfs only)
[ "${PTRAIN_SETUP_DOCKER:-1}" = 1 ] && start_dockerd && DOCKER_OK=1
[ $DOCKER_OK = 1 ] && build_image "$IMAGE" "$SANDBOX_ROOTS" /work work:1777 tmp:1777
build_cad_venv && [ $DOCKER_OK = 1 ] \
  && EXTRA_TREE="$CAD_VENV" build_image "$CAD_IMAGE" "$CAD_ROOTS" /work work:1777 tmp:1777
PTRAIN_ROOTFS=1 build_image "$TERM_IMAGE" "$TERM_ROOTS" / tmp:1777 var/tmp:1777 \
  usr/local/bin:755 usr/local/sbin:755 usr/local/lib:755 usr/local/share:755 home:755 \
  opt:755 srv:755 mnt:755 run:755 var/log:755 var/lib:755
exit 0
