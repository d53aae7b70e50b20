"""Throw-away TLS files for a test etcd cluster: a CA, a server and a client certificate (openssl).

Standard library and the openssl CLI.
"""
import os
import random
import subprocess
import tempfile

from tests.support.etcd_member import random_loopback_host

OPENSSL_TIMEOUT_S = 15.0  # One openssl invocation.


class TlsFiles:
    """PEM files for a cluster with TLS on its client URLs (peers stay plain http): the CA that
    signed both certificates, the members' server certificate and key, optionally a client
    certificate and key for etcdctl (else etcdctl presents the server's, which has no extended
    key usage and so serves as a client certificate too). client_cert_auth: members then require
    a client certificate signed by the CA. ip: the address the server certificate is valid for,
    which EtcdCluster then listens on (make_tls_files sets it)."""

    def __init__(self, ca, cert, key, client_cert=None, client_key=None, client_cert_auth=False,
                 ip=None):
        self.ca, self.cert, self.key = ca, cert, key
        self.client_cert, self.client_key = client_cert, client_key
        self.client_cert_auth = client_cert_auth
        self.ip = ip

    def __repr__(self):
        return "TlsFiles(%r)" % self.__dict__


def make_tls_files(tmpdir, ip=None, client_cert_auth=False):
    """Makes a throw-away CA, a server certificate for IP:<ip> (also IP:127.0.0.1 and
    DNS:localhost) and a client certificate with the openssl CLI, as
    tests/agent/grpc/testdata/make_certs.sh does (EC P-256 keys), in a new directory under tmpdir.
    ip defaults to a random_loopback_host(). Returns their TlsFiles."""
    ip = ip or random_loopback_host()
    out = tempfile.mkdtemp(prefix="etcd-tls.", dir=tmpdir)

    def openssl(*args):
        proc = subprocess.run(["openssl"] + list(args), stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              timeout=OPENSSL_TIMEOUT_S)
        if proc.returncode != 0:
            raise RuntimeError("openssl %s failed (exit %d):\n%s"
                               % (" ".join(args), proc.returncode, proc.stdout.decode()))

    def key(path):
        openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                "-out", path)
        return path

    p = lambda name: os.path.join(out, name)  # noqa: E731
    key(p("ca.key"))
    openssl("req", "-x509", "-new", "-key", p("ca.key"), "-out", p("ca.pem"), "-days", "3650",
            "-subj", "/CN=elrun etcd test CA")
    with open(p("ext"), "w") as f:
        f.write("subjectAltName=IP:%s,IP:127.0.0.1,DNS:localhost\n" % ip)
    for who in ("server", "client"):
        key(p(who + ".key"))
        openssl("req", "-new", "-key", p(who + ".key"), "-out", p(who + ".csr"),
                "-subj", "/CN=elrun etcd %s" % who)
        openssl("x509", "-req", "-in", p(who + ".csr"), "-CA", p("ca.pem"), "-CAkey", p("ca.key"),
                "-set_serial", "0x%016x" % random.getrandbits(63), "-days", "3650",
                "-extfile", p("ext"), "-out", p(who + ".pem"))
    return TlsFiles(ca=p("ca.pem"), cert=p("server.pem"), key=p("server.key"),
                    client_cert=p("client.pem"), client_key=p("client.key"),
                    client_cert_auth=client_cert_auth, ip=ip)

