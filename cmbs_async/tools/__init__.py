"""Small command-line tools the scenario pack needs on machines that lack them."""

import sysconfig

__all__ = ["tools_dir"]


def tools_dir() -> str:
    """Where the programs installed with cmbs (``cmbs-opa``) are: this environment's
    scripts directory."""
    return sysconfig.get_path("scripts")
