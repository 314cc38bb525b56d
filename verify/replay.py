"""Replay one case of one property: ``python -m verify.replay --impl NAME --property PROP --case JSON``.

The case is plain JSON (no pickle, no code): it is parsed, validated field by field, and rebuilt with
the same seed, so the replay computes exactly what the failing example computed. ``--case-file``
reads a failure file written by the report (``failures/*.json``) instead. Exit status: 0 when the
property holds, 1 when it fails (the failure message is printed), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from reports.session import replay_command  # noqa: F401 - the replay command's one form, named with its CLI


def _parse(argv):
    parser = argparse.ArgumentParser(prog="python -m verify.replay", description=__doc__.splitlines()[0])
    parser.add_argument("--impl", help="implementation: registry name, package.module:attr or file.py:attr; a function "
                                             "in another API's calling convention as ...:attr@CONVENTION "
                                             "(flashverify_kernels/calling_conventions.py)")
    parser.add_argument("--property", dest="prop", help="property name (see verify/properties.py)")
    parser.add_argument("--case", help="the case as JSON")
    parser.add_argument("--case-file", help="a failure file from a report's failures/ folder")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    return parser, parser.parse_args(argv)


def main(argv=None) -> int:
    parser, args = _parse(argv)
    import torch

    from flashverify_kernels.registry import ImplementationError, load
    from strategies.cases import AttentionCase, CaseError
    from strategies.softmax import SoftmaxCase
    from verify import properties
    from verify.context import Context

    impl_spec, prop, case_data = args.impl, args.prop, None
    if args.case_file:
        try:
            with open(args.case_file, encoding="utf-8") as fh:
                failure = json.load(fh)
        except (OSError, json.JSONDecodeError) as exc:
            parser.error(f"--case-file {args.case_file!r}: {exc}")
        if not isinstance(failure, dict) or not isinstance(failure.get("case"), dict):
            parser.error(f"--case-file {args.case_file!r} holds no case object")
        case_data = failure["case"]
        prop = prop or failure.get("property")
        impl_spec = impl_spec or _impl_from_replay(failure.get("replay"))
    elif args.case:
        try:
            case_data = json.loads(args.case)
        except json.JSONDecodeError as exc:
            parser.error(f"--case is not valid JSON: {exc}")
    if not impl_spec or not prop or case_data is None:
        parser.error("give --impl, --property and --case (or --case-file)")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        impl = load(impl_spec, device=device)
    except ImplementationError as exc:
        parser.error(str(exc))
    if prop in properties.PROPERTIES:
        fn, case_cls = properties.PROPERTIES[prop], AttentionCase
    elif prop in properties.SOFTMAX_PROPERTIES:
        fn, case_cls = properties.SOFTMAX_PROPERTIES[prop], SoftmaxCase
    else:
        known = sorted(properties.PROPERTIES) + sorted(properties.SOFTMAX_PROPERTIES)
        parser.error(f"--property {prop!r} is not a property; known: {', '.join(known)}")
    if case_cls is AttentionCase and isinstance(case_data, dict) and "causal" in case_data and "spec" not in case_data:
        # A case written before cases carried their spec: its causal flag meant the kernel's alignment.
        spec = {"causal": case_data["causal"], "alignment": impl.causal_alignment}
        case_data = {**{k: v for k, v in case_data.items() if k != "causal"}, "spec": spec}
    try:
        case = case_cls.from_dict(case_data)
    except (CaseError, TypeError) as exc:
        parser.error(f"invalid case: {exc}")
    why = impl.unsupported_spec(case.spec) if case_cls is AttentionCase else None
    if why:
        parser.error(f"the case's attention ({case.spec.describe()}) is not one {impl.name} computes: {why}")
    ctx = Context(impl=impl, prop=prop, device=device, case=case)
    print(f"replaying {prop} on {impl.name} ({device}): {case.describe()}")
    try:
        fn(ctx, case)
    except (properties.NotForThisKernel, properties.NotForThisCase) as exc:
        print(f"not applicable: {exc}")
        return 0
    except AssertionError as exc:
        print(f"FAILED\n{exc}")
        return 1
    print("passed")
    return 0


def _impl_from_replay(replay: str | None) -> str | None:
    if not replay:
        return None
    parts = shlex.split(replay)
    return parts[parts.index("--impl") + 1] if "--impl" in parts else None


if __name__ == "__main__":
    sys.exit(main())
