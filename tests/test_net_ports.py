"""`free_port` answers in one line when no port can bind: an unresolvable host, an address of no interface."""
import threading

import pytest

from rollout import net


def _free_port(host):
    """free_port(host) in a thread: (port, error), or a failure when it is still looping after 20 s."""
    out = {}

    def run():
        try:
            out["port"] = net.free_port(host)
        except OSError as e:
            out["error"] = str(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(20)
    assert not t.is_alive(), f"free_port({host!r}) still looping after 20 s"
    return out.get("port"), out.get("error")


@pytest.mark.timeout(60)
def test_unresolvable_host_is_one_line():
    port, err = _free_port("no-such-host.invalid")
    assert port is None and err.startswith("cannot pick a port on host 'no-such-host.invalid': "), err
    assert "\n" not in err


@pytest.mark.timeout(60)
def test_address_of_no_interface_gives_up_after_its_budget():
    port, err = _free_port("192.0.2.1")   # TEST-NET-1: never an address of this machine
    assert port is None and err == (f"no free port on host '192.0.2.1' after {net.PORT_TRIES} tries "
                                    f"(is it an address of this machine?)"), err


@pytest.mark.timeout(60)
def test_loopback_still_gets_a_port():
    port, err = _free_port("127.0.0.1")
    assert err is None and net.MIN_PORT <= port <= net.MAX_PORT
