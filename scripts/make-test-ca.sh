#!/usr/bin/env bash
# Make a private CA and certificates it signs, for a specserve stack with TLS and mutual TLS
# (docs/security.md). For tests and trials: production certificates come from your PKI.
#
# Usage: scripts/make-test-ca.sh DIR NAME[=SANS] ...
#   DIR   where ca.crt, ca.key and NAME.crt / NAME.key go (created; keys are mode 600)
#   NAME  e.g. orchestrator, target, draft, client
#   SANS  the names the certificate is valid for, openssl's subjectAltName syntax;
#         default DNS:localhost,IP:127.0.0.1
# Example: scripts/make-test-ca.sh pki orchestrator \
#            target=DNS:specserve-target,DNS:localhost,IP:127.0.0.1 draft
# Every certificate may serve and authenticate a client (extendedKeyUsage serverAuth,
# clientAuth): the orchestrator presents the same one to its callers and to the replicas.
# An existing ca.key is reused, so certificates can be added later.
set -euo pipefail
if [ $# -lt 2 ]; then
  sed -n '4,11p' "$0" >&2
  exit 2
fi
dir=$1
shift
mkdir -p "$dir"
cd "$dir"
umask 077
if [ ! -f ca.key ]; then
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
    -keyout ca.key -out ca.crt -days 365 -subj "/CN=specserve test CA" \
    -addext "basicConstraints=critical,CA:TRUE,pathlen:0" \
    -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
fi
for spec in "$@"; do
  name=${spec%%=*}
  sans=DNS:localhost,IP:127.0.0.1
  [ "$spec" != "$name" ] && sans=${spec#*=}
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
    -keyout "$name.key" -out "$name.csr" -subj "/CN=$name" 2>/dev/null
  printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth,clientAuth\nbasicConstraints=critical,CA:FALSE\n' \
    "$sans" >"$name.ext"
  openssl x509 -req -in "$name.csr" -CA ca.crt -CAkey ca.key -CAcreateserial \
    -days 90 -extfile "$name.ext" -out "$name.crt" 2>/dev/null
  rm -f "$name.csr" "$name.ext"
  chmod 644 "$name.crt"
  echo "$dir/$name.crt ($sans)"
done
chmod 644 ca.crt
