"""The kernels flashverify ships and the contract between the suite and a kernel under test.

The contract sits at the root: :mod:`flashverify_kernels.declaration` (``Implementation``, ``declare``),
:mod:`flashverify_kernels.conventions` (how a case's tensors reach a kernel in its sequence convention),
:mod:`flashverify_kernels.calling_conventions` (flash_attn's and xformers' APIs) and
:mod:`flashverify_kernels.registry` (the shipped declarations and ``--impl`` loading). The kernels live
by backend: ``pytorch/`` (the blocked FA1/FA2 algorithms, the online softmax, adapters to PyTorch's own
attention), ``triton/`` (the Triton kernels, their launch replay and the benchmark) and ``hopper/`` (the
Gluon kernels for sm_90).

What a user declares a kernel with::

    from flashverify_kernels.declaration import Implementation, declare
    from flashverify_kernels.calling_conventions import flash_attn_convention, xformers_convention

(This module imports nothing: importing one of its modules never loads the others.)
"""
