#!/bin/sh
# Makes a throw-away CA and server/client certificates for 127.0.0.1 (TLS tests only).
# Usage: make_certs.sh OUT_DIR
set -eu
out=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:prime256v1 -out "$1" 2>/dev/null; }
key "$tmp/ca.key"
openssl req -x509 -new -key "$tmp/ca.key" -out "$out/ca.pem" -days 3650 -subj "/CN=elrun test CA" 2>/dev/null
printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\n' > "$tmp/ext"
for who in server client; do
  key "$out/$who.key"
  openssl req -new -key "$out/$who.key" -out "$tmp/$who.csr" -subj "/CN=elrun $who" 2>/dev/null
  openssl x509 -req -in "$tmp/$who.csr" -CA "$out/ca.pem" -CAkey "$tmp/ca.key" -set_serial "0x$(od -An -N8 -tx1 /dev/urandom | tr -d ' \n')" \
    -days 3650 -extfile "$tmp/ext" -out "$out/$who.pem" 2>/dev/null
done
