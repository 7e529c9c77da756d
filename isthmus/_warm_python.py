"""A Python with jax imported that forks a fresh process for each script it is given.

`isthmus.testing.run_python` runs many short client scripts; each would spend most of its
time importing jax (0.7 s of 0.9 s for a one-line program on a quiet machine). This process
imports jax and numpy once, creates no backend, and then, for each request on its stdin,
forks a child (`isthmus/forking.py`) that takes the request's environment, arguments,
working directory and output files and runs the script as `python script.py` would: as
`__main__`, with the script's folder first on sys.path, ending as the interpreter ends
(non-daemon threads waited for, atexit handlers run, streams flushed) with the script's
exit code.

What jax reads from the environment when it is imported cannot change in a child; the
caller keeps one such process per value of those variables (`warm_pythons.WarmPythons`), apart
from JAX_BACKEND_TARGET, which the child sets in jax's config. Of isthmus it imports only
the fork loop (standard library only), so a child is a plain jax client.

A request is {"id", "script", "argv", "env", "cwd", "stdout", "stderr"}.
"""

import os
import runpy
import sys
import traceback

import jax  # the point of this process (and its config, in the child)
import numpy  # noqa: F401

from isthmus import forking


def _child(request: dict) -> int:
    """Runs in the forked child: becomes `python script args...` and returns its code."""
    forking.redirect(request["stdout"], request["stderr"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    script = request["script"]
    sys.argv = [script, *request["argv"]]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    target = request["env"].get("JAX_BACKEND_TARGET")
    if target is not None:
        jax.config.update("jax_backend_target", target.lower())
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        return forking.exit_code(e)
    except BaseException as e:  # noqa: BLE001 - reported as python reports it
        tb = e.__traceback__  # from the script's frame on, as python prints it
        while tb is not None and tb.tb_frame.f_code.co_filename != script:
            tb = tb.tb_next
        traceback.print_exception(type(e), e, tb or e.__traceback__)
        return 1
    return 0


if __name__ == "__main__":
    forking.serve(forking.Control(), _child)
    os._exit(0)  # the caller went away
