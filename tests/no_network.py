"""Run a script with the network cut off, the loopback aside (tests/test_report.py).

    python tests/no_network.py train.py --report-to trackio ...

Every connection to another host, and every name lookup of one, raises
OSError, and prints a "network blocked" line to stderr first: a library that
swallows the error (trackio turns most of its failures into warnings) still
leaves the line for the test to find.
"""
import os
import runpy
import socket
import sys

LOCAL = ("127.0.0.1", "::1", "localhost", "0.0.0.0")
real_connect = socket.socket.connect
real_connect_ex = socket.socket.connect_ex
real_getaddrinfo = socket.getaddrinfo


def refuse(what):
    print(f"network blocked: {what}", file=sys.stderr, flush=True)
    raise OSError(f"network blocked in this test: {what}")


def connect(sock, address):
    if sock.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in LOCAL:
        refuse(address)
    return real_connect(sock, address)


def connect_ex(sock, address):
    if sock.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in LOCAL:
        refuse(address)
    return real_connect_ex(sock, address)


def getaddrinfo(host, *args, **kwargs):
    if host not in LOCAL and host is not None:
        refuse(host)
    return real_getaddrinfo(host, *args, **kwargs)


socket.socket.connect = connect
socket.socket.connect_ex = connect_ex
socket.getaddrinfo = getaddrinfo

# as `python SCRIPT` would: its folder first on the path
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
runpy.run_path(sys.argv[0], run_name="__main__")
