"""``ember info``: the machine (:func:`ember.core.system_info.system_info`) and which Pallas
kernels each backend has (:mod:`ember.kernels_pallas.kernel_table`)."""

from __future__ import annotations

import argparse
import json

from ember.core.system_info import format_info, system_info
from ember.kernels_pallas.kernel_table import format_kernel_table, kernel_table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")


def run(args: argparse.Namespace) -> int:
    info = system_info()
    table = kernel_table()
    if args.json:
        print(json.dumps({**info, "kernels": table}, indent=2))
    else:
        print(format_info(info) + "\n" + format_kernel_table(table))
    return 0
