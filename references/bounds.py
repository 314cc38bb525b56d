r"""Componentwise first-order rounding-error bounds for attention kernels that follow the contract.

API
---
``forward_bounds(ref, q, k, v, *, dtype) -> (out_bound, lse_bound)``
    ``[B, Hq, Nq, Dv]`` and ``[B, Hq, Nq]`` float64 tensors (``Dv``: v's head dim, ``D`` unless v has one of
    its own; ``D`` is q's and k's, the length of the score dots): a correct kernel given inputs of ``dtype``
    satisfies ``|out - ref.out| <= out_bound`` and ``|lse - ref.lse| <= lse_bound`` elementwise.
``backward_bounds(ref, q, k, v, *, dtype, out) -> (dq_bound, dk_bound, dv_bound, delta_bound)``
    The same for the gradients (``dk``, ``dv`` in key/value-head layout ``[B, Hkv, Nk, D|Dv]``) and for
    ``Delta = rowsum(dO * O)`` ``[B, Hq, Nq]``. ``ref`` must be computed with ``dout``; ``out`` is the
    kernel's own rounded forward output, from which it computes Delta.

``ref`` is the :class:`references.attention.Reference` of the same (already low-precision) inputs. Both
functions take an optional ``model=`` (a :class:`Model`, default ``kernel_model(dtype)``; variants:
``kernel_model(dtype, autograd_eager=True)`` for gradients from PyTorch autograd through the eager
forward, section 11, and ``truncating_dots=True``, section 12).
A bound is exactly 0 only where the error must be 0: rows that see no key (``out = 0``, ``dq = 0``,
``Delta = 0``; ``lse = -inf`` in both, which the metrics count as no error), and keys that no row
sees (``dk = dv = 0``). Everything is vectorised float64 torch: matrix products of absolute values,
a sort per score row, and one ``[rows, Nk, D]`` tensor per chunk of rows for the centred term.
Both functions work in chunks of query rows (:meth:`references.attention.Reference.chunks`, sized by
the memory budget of :mod:`references.attention`): every per-pair term belongs to one row, so the
``out``, ``lse``, ``dq`` and ``Delta`` bounds are computed chunk by chunk, and the per-key sums behind
the ``dk`` and ``dv`` bounds are added over the chunks (per query head) before their final terms. No
``Nq x Nk`` matrix of the whole problem is formed.

1. The model of a kernel
------------------------
Notation, per query row ``i`` of one head (row index dropped where clear): visible keys ``j``, ``n``
of them; ``sigma`` the softmax scale; exact scores ``s_j = sigma q . k_j``, row max ``m``,
``lse = log sum_j exp(s_j)``, ``P_j = exp(s_j - lse)``, ``o = sum_j P_j v_j``. ``u`` is the unit
roundoff of the accumulator (float32, ``2^-24``; float64 for float64 inputs), ``u_in`` that of the
input dtype (``references.metrics.unit_roundoff``). A kernel that follows the contract:

(M1) computes the scores in the accumulator precision: ``s^_j = fl(fl(q . k_j) * fl(sigma))``;
     products of two float16 or bfloat16 numbers are exact in float32;
(M2) keeps the softmax statistics in the accumulator precision, one block of keys at a time in any
     order and any blocking: a running max ``m^(t)``, ``p_j = exp(s^_j - m^(t))``, rescaling factors
     ``alpha = exp(m_old - m_new)``, ``l = alpha l + rowsum(p)``; FA2 keeps ``acc = alpha acc + p V``
     and divides once, FA1 renormalises every step ``o = ((alpha l_old) o + p V) / l_new``; eager
     attention normalises ``P = exp(s^ - m) / l`` first;
(M3) casts the probabilities to the input dtype before ``P @ V`` (a no-op for float32 and float64):
     FA2/FA1 cast the *unnormalised* ``p <= 1`` (relative to the running max), eager attention the
     normalised ``P``;
(M4) accumulates every sum in the accumulator, in any order, over at most ``n`` terms (``Nk`` for a
     query row, ``G * Nq`` for a key in a group of ``G`` query heads);
(M5) rounds ``out`` once to the input dtype after one division; ``lse = m + log(l)`` in the
     accumulator, stored in float32 (float64 for float64 inputs), possibly through base 2;
(M6) backward: ``P^ = exp(s^ - lse_stored)`` (``baseline.backward``: ``softmax(s^)`` in float32;
     autograd through the eager forward is the variant of section 11),
     ``dV = sum_i fl_in(P^) dO``, ``dP = dO . v_j``, ``Delta = rowsum(dO * O)`` from its own rounded
     ``O``, ``dS = fl_in(P^ (dP - Delta))``, ``dQ = sigma sum_j dS k_j``, ``dK = sigma sum_i dS q_i``,
     each accumulated in the accumulator and rounded once to the input dtype.

Arithmetic: the standard model ``fl(a op b) = (a op b)(1 + d)``, ``|d| <= u``, for results in the
normal range; a result below it has an absolute error of at most ``eta``. For the casts ``eta_in`` is
half the smallest subnormal spacing (``u_in * tiny``: ``2^-25`` for float16, ``2^-134`` for
bfloat16); for accumulator results ``eta = tiny`` (``2^-126``), which also covers flush-to-zero.
So every accumulator operation may add an absolute ``eta``, and the bounds add ``eta`` times the
number of operations behind each value: ``2D + 2`` per score, ``3n + 4`` per output element (section
5), ``2D`` per ``dP`` and per Delta, 2 per ``dS``, ``3n + 3`` per ``dQ`` element, ``3 G c_j + 3`` per
``dK`` and ``2 G c_j + 2`` per ``dV`` element (section 7). These terms only matter when values approach
the accumulator's underflow threshold (inputs near float32's or bfloat16's subnormal range, or
products of small values); subnormal *inputs* are assumed to be read as they are.
Rounding a value of magnitude at most ``x`` errs by at most ``r(x) = min(x, max(u x, eta))`` (below
``eta`` the value may round to 0). Elementary functions: ``fl(exp x) = exp(x)(1 + d)``,
``|d| <= C_EXP u``, and ``fl(log x) = log(x)(1 + d) + d'``, ``|d| <= C_LOG u``, ``|d'| <= LOG_ABS u``
(2 ulps, and an absolute term for approximate ``log2``; this covers correctly rounded libms, SLEEF,
CUDA's ``expf``/``logf`` and PTX ``ex2.approx``/``lg2.approx``). ``gamma_n = n u / (1 - n u)``; a sum
of ``n`` terms in any order errs by at most ``gamma_{n-1} sum |terms|`` and a dot product of length
``D`` by ``gamma_D sum |x_t y_t|`` (``gamma_{D-1}`` when the products are exact).

2. Scores
---------
``|s^_j - s_j| <= E_j = gamma_{D+1} sigma sum_t |q_t| |k_jt|`` for float16/bfloat16 inputs (``D - 1``
additions, the rounding of ``sigma`` to float32, the multiply) and ``gamma_{D+2}`` for float32/float64
(``D`` products as well). A kernel that folds ``log2(e)`` into ``sigma`` and uses ``exp2`` rounds
``sigma log2(e)`` instead of ``sigma``: the same count.

3. Forward: perturbed softmax weights (shared by numerator and denominator)
--------------------------------------------------------------------------
Whatever the blocking, key ``j``'s float32 weight in both ``acc`` and ``l`` is
``exp(s^_j - m^) * (1 + theta_j)`` for the final running max ``m^``, where ``theta_j`` collects

* the rounding of the exponent arguments: ``s^_j - m^(t)`` (relative ``u``, so ``u |s^_j - m^(t)| <=
  u (m^ - s^_j + lag)`` absolute in the exponent), a possible multiply by ``log2(e)``, and the arguments
  of the rescaling factors applied after ``j``'s block, whose magnitudes telescope to at most
  ``m^ - m^(t) <= m^ - s^_j + lag``: in all at most ``C_ARG u (m - s_j + lag)`` to first order. ``lag``
  (``Model.lag``, ``MAX_LAG = log(256)`` for a kernel, 0 for the reference) is how far a running max may
  trail the scores it has seen: FlashAttention-4 moves it only when a score beats it by more than
  ``log2(256)`` in base 2, so ``p`` reaches 256 and ``s_j - m^(t)`` is positive up to ``log(256)``;
* ``C_EXP u`` for ``exp`` of ``p_j``, and ``C_EXP u + u`` for each rescaling factor applied after
  ``j``'s block (its ``exp``, and in FA1 the product ``alpha l_old`` used by both numerator and
  ``l``). ``alpha = exp(0) = 1`` is exact and multiplies exactly, so only rescalings where the running
  max grows count; each is caused by a key whose perturbed score beats ``s^_j``, so there are fewer
  than ``R_j = #{k : s_k >= s_j - 2 max_k E_k}`` (``j`` counted) of them, in any order.

So ``|log((1 + theta_j) exp(s^_j - s_j))| <= Phi_j = E_j + C_ARG u (m - s_j + lag) + (C_EXP + 1) u R_j``
(a merge of partials adds section 14's terms).
As the same factor multiplies key ``j`` in ``acc`` and in ``l``, the output sees normalised weights
``P^_j = P_j e^{phi_j} / Z``, ``Z = sum_k P_k e^{phi_k}``, ``|phi_j| <= Phi_j``, and since
``sum_j P^_j = sum_j P_j = 1``, exactly (not only to first order)::

    sum_j (P^_j - P_j) v_j = (1/Z) sum_j P_j (e^{phi_j} - 1) (v_j - o)
    (A)  |.| <= sum_j P_j expm1(Phi_j) |v_j - o| / Z_- ,   Z_- = sum_k P_k e^{-Phi_k}

Centring on ``o`` is what keeps the bound tight for V with a large common offset: a perturbation shared
by all weights changes nothing. (A) holds for large ``Phi`` (logits of 1e4). The kernel's normalised
float32 weights are at most ``P~_j = P_j e^{Phi_j} / Z_- + eta``.

4. Forward: the cast of p (numerator only)
------------------------------------------
FA2/FA1 cast ``x = exp(s^_j - m^(t))`` and scale it afterwards by ``alpha``'s and ``1 / l``; its
normalised contribution is ``x / R`` with ``R = l exp(m^ - m^(t)) >= 1`` (``l >= 1`` because the
maximal key contributes ``exp(0) = 1``). Eager attention casts the normalised ``P^_j`` (``R = 1``). In
both cases the normalised cast error is ``r_in(x) / R = min(x/R, max(u_in x/R, eta_in/R)) <=
r_in(P~_j)``, so one term covers both::

    (B)  sum_j r_in(P~_j) |v_j|

Relative ``u_in`` for normal probabilities; for probabilities below float16's normal range (6.1e-5)
an absolute ``eta_in = 2^-25`` per key (subnormal underflow; unnormalised ``p`` is larger, so FA2
underflows less than eager attention and the eager case is the binding one).

5. Forward: accumulation, division, output rounding
---------------------------------------------------
Each term of ``acc`` passes through at most ``3n + 1`` roundings in the accumulator (its block's dot
product, one addition per later block plus the rescaling multiply in FA2; in FA1 three per later step:
``(alpha l) o``, ``+ p V``, ``/ l_new``); the error of ``l`` scales the output by at most the same
relative amount. Underflow of ``p`` or ``alpha`` in the accumulator loses at most ``eta`` per key in
numerator and denominator::

    (U)  eta (sum_j (|v_j| + |o|) + 3n + 4)
    (C)  gamma_{3n+2} (sum_j P~_j |v_j| + |o| + A + B + U)

Then one division (or a reciprocal and a multiply: ``2u x``) and one rounding to the input dtype
(``r_in``), with ``x = |o| + A + B + C + U``.

6. LSE
------
``m^ + log(l^) = lse + log(sum_j P_j e^{phi_j} (1 + sigma_j))`` where ``|sigma_j| <= gamma_{n + R_j}``
is the summation error of ``l`` (``n - 1`` additions and fewer than ``R_j`` rescaling multiplies on
key ``j``'s path) and underflow adds at most ``n eta`` relative (``l >= 1``). With
``Phi^L_j = Phi_j - log(1 - gamma_{n+R_j})``::

    dlog <= max(log sum_j P_j e^{Phi^L_j} + n eta, -log sum_j P_j e^{-Phi^L_j} + n eta)

plus the ``log`` (``C_LOG u log(l) + LOG_ABS u``, ``log(l) <= lse - m + dlog``) and three roundings of
size ``u |lse|`` (the addition of ``m``, a base-2 conversion, the store to float32).

7. Backward
-----------
* ``P^ = exp(s^ - lse_stored)``: relative error ``pi = E + L + C_ARG u (lse - s) + u |lse| +
  (C_EXP + 2) u`` with ``L`` the forward LSE bound of section 6 (``u |lse|``: converting the stored
  LSE to base 2; the eager backward normalises by its own ``l``, whose error is the same ``dlog``,
  through a reciprocal and a multiply). ``|P^ - P| <= dP_err = P expm1(pi) + eta``,
  ``|P^| <= P~ = P e^{pi} + eta``.
* ``dP^ = fl(dO . v_j)``: ``E_dP = gamma_D sum_t |dO_t| |v_jt|``.
* ``Delta^``: ``|Delta^ - Delta| <= |sum_t dO_t (O_t - o_t)| + sum_t |dO_t| B^ref_t + gamma_D
  sum_t |dO_t| |O_t|``: the first term is *measured* from the kernel's own output ``O`` (this is why
  ``out`` is an argument; with a large V offset it dominates, as it dominates the kernel's actual
  error), ``B^ref`` is the reference output's own bound (section 8).
* ``dS``, exact in the perturbations: ``|P^ (dP^ - Delta^) - P (dP - Delta)| <= dP_err |dP - Delta|
  + P~ (E_dP + E_Delta)``, plus ``2u`` of ``x = P~ (|dP - Delta| + E_dP + E_Delta)`` for the
  subtraction and the product, plus ``r_in(x)`` for the cast.
* ``dQ_i = sigma sum_j dS_ij k_j``: ``sigma (sum_j |dS error| |k_j| + gamma_{n+3} sum_j |dS^| |k_j|)``
  then ``r_in``; ``dK_j`` likewise over the ``G c_j`` rows of its group that see it (``c_j`` rows per
  head), ``dV_j = sum_i fl_in(P^) dO_i``: ``sum_i (dP_err + r_in(P~)) |dO_i| + gamma_{G c_j + 2}
  sum_i (P~ + r_in(P~)) |dO_i|`` then ``r_in``.
* The returned Delta bound compares with ``ref.delta`` (from the same reference output), so it is
  ``|sum_t dO_t (O_t - ref.out_t)| + gamma_D sum_t |dO_t| |O_t|`` plus float64 rounding.

8. The float64 reference is rounded too
---------------------------------------
Every bound adds the reference's own error against exact attention, from the same analysis with
``u = 2^-53`` and no casts. The reference forms ``exp(s - lse)`` without renormalising, so its
perturbations are bounded uncentred: ``pi^ref = E^ref + L^ref + u (lse - s) + C_EXP u`` and
``B^ref = sum_j (P expm1(pi^ref) + eta) |v_j| + gamma_{n+1} sum_j P~^ref |v_j|``. It matters only
for float64 inputs, where it roughly doubles the bound.

9. Which terms dominate; how tight it is
----------------------------------------
Measured ``max err/bound`` per example (medians over ~800 random and adversarial examples with
Nq, Nk <= 48, D <= 64, blocks 1..64, for the blocked FA2/FA1 and the eager baseline):

* float16/bfloat16 forward: (B) and the output rounding, ``u_in (sum_j P_j |v_j| + |o|)``, dominate.
  The bound adds the cast errors of all keys with one sign; the kernel's errors partly cancel. Medians
  0.4-0.6 (max 0.93). In the subnormal range ``eta_in`` dominates.
* float16/bfloat16 backward: the dS and P casts and the final rounding; medians 0.45-0.75 for dQ, dK,
  dV. With a large V offset the measured Delta term dominates dS. Where the final rounding alone
  dominates, the ratio is capped at ``1/SAFETY = 0.94`` and correct kernels get close to it; the
  Delta bound is the measured term plus one rounded sum, so its ratio sits near 0.94 too.
* The LSE is a float32 quantity for every input dtype: ``E_j`` and ``gamma_{n+R_j}`` dominate. These
  are worst-case sums (``D`` and ``n`` roundings of one sign) while a correct kernel's rounding errors
  grow like ``sqrt(D)`` and ``sqrt(n)`` and average over keys, so the LSE bound is loose by roughly
  ``sqrt(D n)``: medians 0.03-0.05 for these sizes, about 0.01 at D = 64, Nk = 128.
* float32 (everything) and float64: the worst-case ``gamma_{3n+2}`` and ``gamma_D`` terms dominate, so
  the bound is loose by about ``sqrt(n)`` (float32 medians: out 0.03, LSE 0.05, gradients 0.013-0.025;
  for long rows more: out about 0.002 at Nk = 400, because ``3n + 2`` is FA1's worst case at
  ``block_n = 1``). For float64 the kernel and the reference run nearly the same operations and their
  errors correlate, so ratios are lower still (out 0.014, gradients 0.002-0.006): the bounds are still
  about 1e-13 relative, far below any algorithmic mistake.
* Large logits: ``E_j`` (relative score error times ``|s|``) dominates Phi, the LSE and P^.

10. What is not first order
---------------------------
Sections 3, 6 and the dS perturbation are exact in the perturbations (exponentials instead of
first-order sums). Dropped are products of two rounding errors, e.g. ``u u_in`` when a rounded value
is rounded again, relative size at most ``max(u_in, gamma_{3n+2}) <= 4e-3`` for the sizes this suite
draws; ``SAFETY`` covers them about fifteen times over. Bounds on inputs at overflow (``inf`` scores
or outputs) are not meaningful.

11. Variant: PyTorch autograd through the eager forward
-------------------------------------------------------
Differentiating ``references.baseline.forward`` with autograd (the ``eager`` implementation) is not the
contract's backward: the gradient of the cast ``P.to(dtype)`` rounds ``dP = dO V^T`` to the input
dtype; ``Delta`` becomes ``sum_k P_k dP_k`` (the softmax backward, from the rounded ``dP``) instead of
``rowsum(dO * O)``; ``dS`` comes through the ``e / l`` chain; the gradient of the row max ``m``
(``-sum_j dS_j``, zero in exact arithmetic but not after rounding) lands on the keys that may be the
row max; and the gradient of ``expand_kv(k).to(float32)`` rounds each query head's ``dK``, ``dV`` to the
input dtype before the group sum. ``kernel_model(dtype, autograd_eager=True)`` adds these terms:
``E_dP += r_in(|dP| + E_dP)``; ``E_Delta = sum_k (dP_err_k |dP_k| + P~_k E_dP_k) + gamma_{n+2}
sum_k P~_k (|dP_k| + E_dP_k)``; ``6u (P~ (|dP| + E_dP) + P~ sum_k P~_k (|dP_k| + E_dP_k))`` for the
chain; ``sum_j |dS error| + gamma_{n+2} sum_j |dS^|`` on the keys within ``2 max E`` of the row max;
a rounding per head and ``gamma_{G-1}`` in the input dtype for the group sum. The variant's bound is
wider, and has to be: autograd eager exceeds the contract's dQ and dK bounds by up to ~100x in
bfloat16 and ~5x in float32 (the rounded ``dP`` costs ``u_in |dP|``, and Delta and the row max's
gradient formed from it cost ``gamma_n sum_k P_k |dP_k|``, where the contract's backward pays
``gamma_D |dO| |v|`` and a Delta measured from ``O``). In float16 it overflows when ``|dP|`` passes
65504, which no bound excuses.

12. Variant: truncating matrix units
-----------------------------------
``kernel_model(dtype, truncating_dots=True)`` doubles the unit roundoff of the
accumulator inside dot products (``P @ V``, ``Q K^T``, ``dO V^T``, ``dS K``, ``dS^T Q``,
``P^T dO``): a simple allowance for matrix units that truncate instead of rounding to nearest when
they accumulate (as published measurements report for NVIDIA tensor cores with float16/bfloat16
operands), not a validated model of any one unit. The default is the standard model of the contract,
which is what the CPU runs here and IEEE float32 dots on GPUs follow.

13. Score modifications: softcap and ALiBi
------------------------------------------
The spec's modifications (``references.spec``) change the scores before the softmax; everything after
them (sections 3-8) reads the modified scores ``s'`` and their error ``E'``, which the kernel computes
in the accumulator from its own rounded ``s^`` (error ``E``, section 2):

* softcap ``c``: ``x = fl(s^ / c)``, ``t = tanh(x)`` within ``C_TANH`` roundings, ``s' = fl(c t)``.
  ``tanh`` is 1-Lipschitz, so ``E' = E + u (|s| + E) + (C_TANH + 2) u (|c t| + E + u |s|) + 3 eta``
  (``|s|`` bounded by ``sigma |q| . |k|``; relative to the capped score, not the cap: a cap far above
  the scores costs a few roundings of ``|s|``, as plain attention does).
* ALiBi: ``b = fl(-slope |i + offset - j|)`` (the distance is an exact integer) and ``fl(s' + b)``:
  ``+ u (|b| + |s' + b|) + 2 eta``.

Backward: ``dS`` is the gradient of the modified scores; with a softcap, ``dQ`` and ``dK`` take
``dS_raw = dS (1 - t^2)``. The kernel's ``t^`` is off by ``dt = E / c + u (|s| / c) + (C_TANH + 1) u``,
its ``1 - t^2`` by ``dc = 2 dt + dt^2 + 2 u``; so ``|dS_raw^ - dS_raw| <= err(dS) (1 - t^2 + dc)
+ |dS^| dc + u |dS^| (1 - t^2 + dc) + eta``, and ``|dS_raw^| <= |dS^| (1 - t^2 + dc)(1 + u) + eta``, before
the cast to the input dtype: the cast is of ``dS_raw`` (``r_in(|dS_raw^|)``), whose absolute floor ``eta_in``
(probabilities near the subnormal range) the chain's factor does not shrink.
ALiBi's bias is a constant: no change in the backward.

14. Partials merged through stored LSEs (split-KV, ring attention), in every kernel
-----------------------------------------------------------------------------------
Any kernel may cut the keys into runs, keep each run's normalised partial ``o_t = acc_t / l_t`` and
``lse_t = m_t + log(l_t)`` in the accumulator dtype, and merge them, whether or not the caller asked for
splits (the spec's ``num_splits``): FlashAttention-2's split-KV forward picks its own split count (up to 128),
FlashDecoding and flashinfer's ``merge_state`` merge partials, ring attention folds one device's chunk of
keys in at a time. The suite cannot see the partition, so every kernel bound carries these terms
(``Model.merges``; the float64 reference does not split). Two merges are covered:

* one pass over the ``S`` partials: ``lse = top + log(sum_t exp(lse_t - top))``, ``out = sum_t exp(lse_t -
  lse) o_t`` (empty runs have ``lse_t = -inf`` and add exact zeros);
* up to ``MERGE_STEPS`` folds, one run at a time: ``new = lse ⊕ lse_t`` (a log of a sum of two
  exponentials), ``out = exp(lse - new) out + exp(lse_t - new) o_t``.

What a merge adds to key ``j``'s weight (``j`` in run ``t``), added to ``Phi_j`` where (A) centres it:

* the stored ``lse_t`` is not compensated by ``o_t`` (normalised by ``l_t``, not by ``exp(lse_t - m_t)``):
  a log, an addition and a store, ``C_LOG u log(n + 1) + LOG_ABS u + 2 u |lse_t|`` with
  ``|lse_t| <= max(|s_j|, |m| + log n)`` (``s_j <= lse_t <= lse``);
* each merge's weight ``exp(fl(lse_t - new))`` and its multiply: ``u (lse - s_j) + (C_EXP + 1) u``, since
  ``|lse_t - new| <= lse - s_j``, once per merge the key's weight passes, at most ``min(n, MERGE_STEPS)``
  times. A fold's rounded running LSE ``new`` needs no term: the running output is normalised by that same
  rounded value, and the next fold's weight ``exp(new - new')`` undoes it.

Weighted by ``P_j`` these per-merge terms sum to ``u sum_j P_j (lse - s_j) <= u log n`` per merge (the
entropy of the row), however large the logits. The merged ``lse``'s own rounding, ``delta = u (|lse| +
C_EXP + S + C_LOG log S + LOG_ABS)`` with ``S <= n`` non-empty terms (the sum of ``S`` exponentials, a
log, the addition of ``top``), is common to every weight, so the weights no longer sum to 1:
``delta (|o| + ...)`` joins the output bound and ``delta`` the LSE bound. With large logits this is the
term that matters: ``|lse|`` in the hundreds costs ``u |lse| |o|``, uncentred. A term of the output passes
its run's ``3 n_t + 1`` roundings, the division by ``l_t``, then two roundings per merge (the weight's
multiply and the addition); as ``n_t <= n - S + 1``, ``3 n + 3 + 2 min(n, MERGE_STEPS)`` roundings cover
every partition in (C). The backward does not split; it reads the merged LSE, whose bound carries all this.

15. Sinks
---------
A sink ``t_h`` is one more key of every row with an exact score (no product: its ``E`` is the ``2 u |t_h|``
of a conversion to base 2) and value 0. The bounds append it as a last column to every score-level
quantity (``P_sink``, the score ``t_h``, visible everywhere) and a zero key to ``|k|``, ``|v|``, ``v``:
sections 3-7 then hold as written (the centred term (A) sees ``|0 - o|``, the cast (B) and ``P V`` see value
0, the row max and ``R_j`` include the sink, every row has a key), and the backward's ``dS`` of that
column, ``P_sink (0 - Delta)``, is the sink's gradient: ``dt_h = sum_{b, i} dS_sink`` gets the sum of its
errors plus ``gamma`` of its ``B Nq`` additions and the rounding of the float32 result, and leaves the
``dK``, ``dV`` sums.

16. Float8 inputs (forward only)
--------------------------------
The quantities of sections 2-6 are those of the dequantised inputs (``references/fp8.py``: what the
float8 values and their descales stand for, exact in float64). A float8 kernel (FlashAttention-3's fp8
forward) differs from (M1)-(M5) in three places, each in the model of :func:`kernel_model`:

* scores: the dot of two float8 vectors in float32 (products of 4-bit significands are exact, ``D - 1``
  additions) times ``fl(fl(fl(sigma) q_descale) k_descale)``: four roundings beyond the additions, relative
  to ``sigma sum_t |q_t| |k_jt|`` of the dequantised values (the descales scale both sides alike);
* the cast of the unnormalised ``p <= 1`` to v's float8 format (section 4): ``u_cast`` is float8's unit
  roundoff (``2^-4`` e4m3, ``2^-3`` e5m2) and ``eta_cast`` half its smallest subnormal spacing
  (``2^-10``, ``2^-17``): a weight below it may be flushed to zero, which term (B) prices per key;
* the output: the accumulator times ``v_descale`` (one more rounding beside the division's two) and the
  final rounding to bfloat16 (``u_out = 2^-8``), not to the inputs' format.

17. Which term covers which family of algorithm
-----------------------------------------------
``tests/zoo`` holds a correct kernel of each family and ``tests/test_zoo.py`` runs them all through
``pytest verify``; docs/soundness.md has their margins. What each family's arithmetic costs, and where:

* one pass, ``P`` rounded to the input dtype before ``P @ V`` (FlashAttention-2, Triton kernels): section 3
  (rescalings, at most ``R_j``), 4 (the cast, term (B)), 5 (``3n + 2`` roundings in (C));
* FA1's output renormalised every step: section 3 (``alpha l_old``) and 5 (three roundings a step);
* the softmax materialised (eager, SDPA's math backend): section 4 (the cast of the normalised ``P``) and,
  for autograd's backward, section 11;
* key tiles in any order (last-first), two passes (a max pass, then no rescaling): section 3 holds for any
  order and blocking, and (C) for any summation order;
* a lagging running max (FlashAttention-4's conditional rescaling): section 3's ``lag``;
* base 2 (``log2(e)`` folded into the scale, ``exp2`` of one FMA, the LSE in base 2): section 2 (the
  rounding of ``sigma log2(e)``), 3 (the multiply by ``log2(e)`` in ``C_ARG``), 6 (the conversion of the
  LSE, one of its three ``u |lse|``), 7 (the backward's conversion of the stored LSE, ``u |lse|``);
* partials merged through stored LSEs (split-KV chosen by the kernel, ring attention): section 14;
* gradients summed in any order (atomics): section 1 (M4) and 7 (``gamma`` of the count, any order).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from references.attention import (CENTRED_CHUNK_ELEMENTS, EXACT_CENTRED_LIMIT, Chunk, Reference, expand_kv,
                                  reduce_group)
from references.fp8 import FP8_OUT_DTYPE, is_fp8
from references.metrics import unit_roundoff

F64 = torch.float64

C_EXP = 4.0  # exp within 2 ulps: relative error <= 4u
C_LOG = 4.0  # log within 2 ulps
LOG_ABS = 4.0  # absolute allowance of an approximate log2, in u
C_TANH = 4.0  # tanh within 4 ulps (libm and CUDA's tanhf are within 2; not the approximate tanh.approx.f32)
C_ARG = 4.0  # roundings that land in an exponent argument, per unit of |argument| (section 3)
SAFETY = 1.0625  # dropped second-order terms (section 10)
MAX_LAG = math.log(256.0)  # how far a kernel's running max may trail its scores (lazy rescaling; section 3)
MERGE_STEPS = 8  # folds of partials a key's weight may pass through (ring attention over 9 devices; section 14)
# The centred term (A): exact in row chunks up to EXACT_CENTRED_LIMIT elements (references.attention, whose
# memory estimate counts it).
_CHUNK_ELEMENTS = CENTRED_CHUNK_ELEMENTS


@dataclasses.dataclass(frozen=True)
class Model:
    """Rounding parameters of one computation that follows the contract (module docstring, section 1).

    ``u_acc``/``eta_acc``: the accumulator and statistics; ``u_dot``: inside dot products (``u_acc``,
    or ``2 u_acc`` for truncating matrix units); ``score_roundings``: roundings of a score beyond the
    ``D - 1`` additions; ``u_cast``/``eta_cast``: the cast of ``p`` and ``dS`` (0 without a cast);
    ``u_out``/``eta_out``: the final rounding to the input dtype (0 when it is the accumulator);
    ``autograd_eager``: the backward is PyTorch autograd through the eager forward (section 11);
    ``merges``: the computation may merge partials through stored LSEs (section 14); ``lag``: how far its
    running max may trail the scores seen (section 3). Every kernel may do both, the float64 reference neither.
    ``out_roundings``: roundings of the accumulator beyond the division's (float8's ``v_descale``, section 16).
    """

    name: str
    u_acc: float
    eta_acc: float
    u_dot: float
    score_roundings: int
    u_cast: float = 0.0
    eta_cast: float = 0.0
    u_out: float = 0.0
    eta_out: float = 0.0
    autograd_eager: bool = False
    merges: bool = True
    lag: float = MAX_LAG
    out_roundings: int = 0


def kernel_model(dtype: torch.dtype, *, truncating_dots: bool = False, autograd_eager: bool = False) -> Model:
    """The contract's rounding model for inputs of ``dtype`` (module docstring, section 1);
    ``truncating_dots`` and ``autograd_eager`` select the variants of sections 10 and 11."""
    u_in = unit_roundoff(dtype)
    dots = 2.0 if truncating_dots else 1.0
    name = str(dtype).removeprefix("torch.")
    if is_fp8(dtype):  # section 16: forward only; scores through the descales, p cast to float8, out bfloat16
        u_a, eta_a = unit_roundoff(torch.float32), torch.finfo(torch.float32).tiny
        u_out = unit_roundoff(FP8_OUT_DTYPE)
        return Model(name, u_a, eta_a, dots * u_a, 4, u_in, torch.finfo(dtype).tiny * u_in, u_out,
                     torch.finfo(FP8_OUT_DTYPE).tiny * u_out, autograd_eager=autograd_eager, out_roundings=1)
    if dtype == torch.float64:
        return Model(name, u_in, torch.finfo(F64).tiny, dots * u_in, 3, autograd_eager=autograd_eager)
    u_a = unit_roundoff(torch.float32)
    eta_a = torch.finfo(torch.float32).tiny  # float32 underflow, flush-to-zero included
    if dtype == torch.float32:
        return Model(name, u_a, eta_a, dots * u_a, 3, autograd_eager=autograd_eager)
    eta_in = torch.finfo(dtype).tiny * u_in  # half the smallest subnormal spacing
    # float16/bfloat16 products are exact in float32: D - 1 additions, sigma's rounding, the multiply.
    return Model(name, u_a, eta_a, dots * u_a, 2, u_in, eta_in, u_in, eta_in, autograd_eager=autograd_eager)


# The float64 reference: products rounded, sigma exact, no casts (section 8).
REFERENCE_MODEL = Model("float64 reference", unit_roundoff(F64), torch.finfo(F64).tiny, unit_roundoff(F64), 2,
                        merges=False, lag=0.0)


def gamma(n, u: float):
    """``gamma_n = n u / (1 - n u)`` (elementwise for tensors); ``inf`` once ``n u >= 1``."""
    if isinstance(n, torch.Tensor):
        nu = n.to(F64) * u
        return torch.where(nu < 1, nu / (1 - nu), math.inf)
    nu = n * u
    return nu / (1 - nu) if nu < 1 else math.inf


def rounding_error(x: torch.Tensor, u: float, eta: float) -> torch.Tensor:
    """``r(x) = min(x, max(u x, eta))``: the largest error of rounding a value of magnitude at most
    ``x`` (nearest, or to zero below the normal range). Zero where ``x`` is zero."""
    return torch.minimum(x, torch.clamp(u * x, min=eta))


@dataclasses.dataclass
class _Keys:
    """Per-key float64 magnitudes shared by every row chunk (query-head layout ``[B, Hq, Nk, D]``)."""

    keys: torch.Tensor  # bool [Nk]: keys some row sees
    n_keys: torch.Tensor  # rows that see each key [Nk]
    n_rows: torch.Tensor  # visible keys per row [Nq] (all rows)
    len_q: int  # rows of the whole problem
    group: int
    heads_kv: int
    d: int  # the score dots' length: q's and k's head dim
    dv: int  # v's head dim: the length of dP = dO . v_j and of Delta = rowsum(dO * O)
    scale: float
    ak: torch.Tensor  # |k| expanded to query heads, 0 for keys no row sees
    av: torch.Tensor  # |v| likewise
    v: torch.Tensor  # v likewise


@dataclasses.dataclass
class _Case:
    """Float64 magnitudes of one chunk of query rows ``r0 .. r1 - 1`` (query-head layout); the
    row-sized fields cover the chunk only, the key-sized ones the whole problem."""

    vis: torch.Tensor  # bool [rows, Nk]
    rows: torch.Tensor  # bool [rows]: rows that see a key
    keys: torch.Tensor  # bool [Nk]: keys some row sees
    n_rows: torch.Tensor  # visible keys per row [rows]
    n_keys: torch.Tensor  # rows that see each key [Nk]
    len_q: int  # rows of the whole problem
    group: int
    heads_kv: int
    d: int  # q's and k's head dim
    dv: int  # v's head dim
    scale: float
    p: torch.Tensor  # [B, Hq, rows, Nk]
    s: torch.Tensor  # scores, 0 where hidden
    m: torch.Tensor  # row max, 0 on empty rows [B, Hq, rows]
    lse: torch.Tensor  # 0 on empty rows
    qk: torch.Tensor  # |sigma| |q_i| . |k_j|, 0 where hidden
    aq: torch.Tensor  # |q| [B, Hq, rows, D]
    ak: torch.Tensor  # |k| expanded to query heads, 0 for keys no row sees [B, Hq, Nk, D]
    av: torch.Tensor  # |v| likewise
    v: torch.Tensor  # v likewise
    o: torch.Tensor  # reference output [B, Hq, rows, Dv]
    cap: float | None = None  # the spec's softcap
    tanh: torch.Tensor | None = None  # softcap: tanh(s_raw / cap) of the reference, 0 where hidden
    bias_abs: torch.Tensor | None = None  # ALiBi: |bias| [Hq, rows, Nk], 0 where hidden
    # Sinks: the last column of every score-level tensor (and the last key of ak, av, v) is the sink, a key
    # with score t_h, no product and value 0 (section 15); sink_abs is |t_h| in that column, 0 elsewhere.
    sink_abs: torch.Tensor | None = None


def _keys(ref: Reference, q, k, v) -> _Keys:
    hq, hkv = q.shape[1], k.shape[1]
    if tuple(ref.out.shape) != (*q.shape[:3], v.shape[-1]) or ref.len_k != k.shape[2]:
        raise ValueError(f"ref.out.shape={tuple(ref.out.shape)} with {ref.len_k} keys does not fit "
                         f"q.shape={tuple(q.shape)}, k.shape={tuple(k.shape)} and v.shape={tuple(v.shape)}: the "
                         "reference should come from these inputs")
    n_rows, n_keys = ref.spec.counts(q.shape[2], k.shape[2], device=q.device)
    keys = n_keys > 0
    # Keys no row sees may hold anything (inf, NaN): zero them before any product.
    ke = torch.where(keys[:, None], expand_kv(k.detach().to(F64), hq), 0.0)
    ve = torch.where(keys[:, None], expand_kv(v.detach().to(F64), hq), 0.0)
    return _Keys(keys=keys, n_keys=n_keys.to(F64), n_rows=n_rows.to(F64), len_q=q.shape[2], group=hq // hkv,
                 heads_kv=hkv, d=q.shape[-1], dv=v.shape[-1], scale=ref.scale, ak=ke.abs(), av=ve.abs(), v=ve)


def _case(ref: Reference, q, kk: _Keys, chunk: Chunk) -> _Case:
    r = slice(chunk.r0, chunk.r1)
    vis = chunk.visible
    n_rows = kk.n_rows[r]
    rows = n_rows > 0
    aq = q[:, :, r].detach().to(F64).abs()
    qk = torch.where(vis, abs(ref.scale) * (aq @ kk.ak.transpose(-1, -2)), 0.0)
    spec, scores = ref.spec, torch.where(vis, chunk.scores, 0.0)
    bias = tanh = None
    if spec.alibi_slopes is not None:
        bias = torch.where(vis, spec.alibi_bias(ref.len_q, ref.len_k, heads=q.shape[1], device=q.device,
                                                rows=(chunk.r0, chunk.r1)), 0.0)
    if spec.softcap is not None:
        tanh = torch.where(vis, (scores - (0.0 if bias is None else bias)) / spec.softcap, 0.0)
    c = _Case(
        vis=vis, rows=rows, keys=kk.keys, n_rows=n_rows, n_keys=kk.n_keys, len_q=kk.len_q,
        group=kk.group, heads_kv=kk.heads_kv, d=kk.d, dv=kk.dv, scale=kk.scale, p=chunk.p, s=scores,
        m=torch.where(rows, ref.row_max[:, :, r], 0.0), lse=torch.where(rows, ref.lse[:, :, r], 0.0),
        qk=qk, aq=aq, ak=kk.ak, av=kk.av, v=kk.v, o=ref.out[:, :, r],
        cap=spec.softcap, tanh=tanh, bias_abs=None if bias is None else bias.abs(),
    )
    return c if ref.sink is None else _with_sink(c, ref, r)


def _column(t: torch.Tensor, value) -> torch.Tensor:
    """``t`` with one more column (last dimension) holding ``value`` (a scalar, or a tensor that broadcasts
    to ``t``'s shape with a last dimension of 1)."""
    extra = torch.zeros(t.shape[:-1] + (1,), dtype=t.dtype, device=t.device)
    return torch.cat([t, extra + value], dim=-1)


def _key_row(t: torch.Tensor) -> torch.Tensor:
    """``[B, Hq, Nk, D]`` with one more key of zeros."""
    return torch.cat([t, t.new_zeros(t.shape[:2] + (1,) + t.shape[3:])], dim=2)


def _with_sink(c: _Case, ref: Reference, r: slice) -> _Case:
    """``c`` with the sink as one more key every row sees (section 15): score t_h, P_sink, no product
    (``qk`` 0), value 0; the row max and the counts include it, so every row has a key."""
    sink = ref.sink[:, None, None]  # [Hq, 1, 1]
    vis = _column(c.vis, True)
    keys, n_keys = torch.cat([c.keys, c.keys.new_ones(1)]), torch.cat([c.n_keys, c.n_keys.new_full((1,), c.len_q)])
    m = torch.maximum(torch.where(c.rows, ref.row_max[:, :, r], -math.inf), ref.sink[:, None])
    return dataclasses.replace(
        c, vis=vis, rows=torch.ones_like(c.rows), keys=keys, n_rows=c.n_rows + 1, n_keys=n_keys,
        p=_column(c.p, ref.p_sink[:, :, r, None]), s=_column(c.s, sink), m=m, lse=ref.lse[:, :, r],
        qk=_column(c.qk, 0.0), ak=_key_row(c.ak), av=_key_row(c.av), v=_key_row(c.v),
        tanh=None if c.tanh is None else _column(c.tanh, 0.0),
        bias_abs=None if c.bias_abs is None else _column(c.bias_abs, 0.0),
        sink_abs=_column(torch.zeros_like(c.s[0, :, :1, :]), sink.abs()))


def _raw_score_error(c: _Case, model: Model) -> torch.Tensor:
    """E_ij (section 2), with an absolute eta per product, addition and the scaling (underflow)."""
    return gamma(c.d - 1 + model.score_roundings, model.u_dot) * c.qk + (2 * c.d + 2) * model.eta_acc


def _score_error(c: _Case, model: Model) -> torch.Tensor:
    """E'_ij: the error of the scores the softmax sees, the spec's modifications included (section 13)."""
    err = _raw_score_error(c, model)
    u, eta = model.u_acc, model.eta_acc
    if c.cap is not None:
        capped = c.cap * c.tanh.abs()  # |c t| of the reference; the kernel's is within err + u |s| of it
        err = err + u * (c.qk + err) + (C_TANH + 2) * u * (capped + err + u * c.qk) + 3 * eta
    if c.bias_abs is not None:
        err = err + u * (c.bias_abs + c.s.abs()) + 2 * eta
    if c.sink_abs is not None:  # a kernel may convert the sink to base 2: t log2(e), one rounding each way
        err = err + 2 * u * c.sink_abs
    return err


def _softcap_chain(c: _Case, model: Model, ds_err: torch.Tensor, ds_abs: torch.Tensor):
    """``(err, magnitude)`` of ``dS_raw = dS (1 - t^2)`` from those of ``dS`` (section 13)."""
    u, eta = model.u_acc, model.eta_acc
    dt = _raw_score_error(c, model) / c.cap + u * c.qk / c.cap + (C_TANH + 1) * u
    dc = 2 * dt + dt * dt + 2 * u
    chain = 1 - c.tanh * c.tanh + dc
    err = ds_err * chain + ds_abs * dc + u * ds_abs * chain + eta
    return torch.where(c.vis, err, 0.0), torch.where(c.vis, ds_abs * chain * (1 + u) + eta, 0.0)


def _ranks(c: _Case, tol: torch.Tensor) -> torch.Tensor:
    """R_ij = #{visible k : s_ik >= s_ij - tol_i} (j counted), 0 where hidden (section 3)."""
    s = torch.where(c.vis, c.s, -math.inf)
    ordered, _ = torch.sort(s, dim=-1)
    below = torch.searchsorted(ordered.contiguous(), (s - tol[..., None]).contiguous(), right=False)
    return torch.where(c.vis, (s.shape[-1] - below).to(F64), 0.0)


def _centred(c: _Case, w: torch.Tensor) -> torch.Tensor:
    """``sum_j w_ij |v_j - o_i|`` for ``w >= 0`` (0 where hidden), or an upper bound of it."""
    b, h, nq, nk = w.shape
    if b * h * c.len_q * nk * c.dv <= EXACT_CENTRED_LIMIT:  # decided on the whole problem, not the chunk
        step = max(1, _CHUNK_ELEMENTS // max(1, b * h * nk * c.dv))
        parts = [torch.einsum("bhij,bhijd->bhid", w[:, :, i0:i0 + step],
                              (c.v[:, :, None] - c.o[:, :, i0:i0 + step, None]).abs())
                 for i0 in range(0, nq, step)]
        return torch.cat(parts, dim=2) if parts else torch.zeros_like(c.o)
    # |v_j - o_i| <= |v_j - a| + |o_i - a| for any a: the better of a = 0 and a = the mean of v.
    wsum = w.sum(dim=-1, keepdim=True)
    at_zero = w @ c.av + wsum * c.o.abs()
    mean = c.v.sum(dim=-2, keepdim=True) / c.keys.sum().clamp(min=1)
    at_mean = w @ torch.where(c.keys[:, None], (c.v - mean).abs(), 0.0) + wsum * (c.o - mean).abs()
    return torch.minimum(at_zero, at_mean)


def _ranks_for(c: _Case, model: Model) -> torch.Tensor:
    """R_ij with the kernel model's tolerance; the reference's is smaller, and a wider tolerance only
    counts more keys, so one sort serves both."""
    err = _score_error(c, model)
    tol = 2 * err.amax(dim=-1) + 4 * unit_roundoff(F64) * (c.s.abs().amax(dim=-1) + 1)
    return _ranks(c, tol)


def _phi(c: _Case, model: Model, ranks: torch.Tensor) -> torch.Tensor:
    """Phi_ij (section 3, and section 14's merge terms for a kernel), 0 where hidden."""
    u = model.u_acc
    phi = _score_error(c, model) + C_ARG * u * (c.m[..., None] - c.s + model.lag) + (C_EXP + 1) * u * ranks
    if model.merges:
        phi = phi + _merge_phi(c, u)
    return torch.where(c.vis, phi, 0.0)


def _merges(c: _Case) -> torch.Tensor:
    """The most merges a key's weight passes (section 14), per row ``[rows]``: ``min(n, MERGE_STEPS)``."""
    return c.n_rows.clamp(max=MERGE_STEPS)


def _merge_phi(c: _Case, u: float) -> torch.Tensor:
    """Section 14: key j's run stores ``lse_t = m_t + log(l_t)`` (a log, an addition, a float32 store:
    ``C_LOG u log(n + 1) + LOG_ABS u + 2 u |lse_t|``, ``|lse_t| <= max(|s_j|, |m| + log n)``), and each merge
    weighs it by ``exp(fl(lse_t - new))`` and multiplies (``u (lse - s_j) + (C_EXP + 1) u`` a merge)."""
    log_n = torch.log(c.n_rows.clamp(min=1))[:, None]
    lse_t = torch.maximum(c.s.abs(), c.m.abs()[..., None] + log_n)
    per_merge = (c.lse[..., None] - c.s).abs() + C_EXP + 1
    return u * (C_LOG * torch.log1p(c.n_rows)[:, None] + LOG_ABS + 2 * lse_t + _merges(c)[:, None] * per_merge)


def _merge_error(c: _Case, model: Model) -> torch.Tensor:
    """Section 14: the relative error ``delta`` of the merged LSE, common to every run's weight: the one-pass
    merge's sum of ``n`` exponentials and its log, ``u (n + C_LOG log n)``, and each of the
    ``min(n, MERGE_STEPS)`` merges' log, exponential and addition, ``u (L + C_EXP + C_LOG + LOG_ABS + 1)``
    with ``L = max(|lse|, max_j |s_j|)`` bounding every partial LSE (0 for a computation that does not merge)."""
    if not model.merges:
        return torch.zeros_like(c.lse)
    n = c.n_rows.clamp(min=1)
    top = torch.maximum(c.lse.abs(), torch.where(c.vis, c.s.abs(), 0.0).amax(dim=-1) if c.s.shape[-1] else 0.0)
    return model.u_acc * (n + C_LOG * torch.log(n) + _merges(c) * (top + C_EXP + C_LOG + LOG_ABS + 1))


def _p_times(c: _Case, fn, x: torch.Tensor) -> torch.Tensor:
    """``P * fn(x)`` (``fn`` is exp or expm1 of a relative-error exponent ``x``) without ``0 * inf``.

    Where ``P = exp(s - lse)`` underflows to 0 the product is ``exp(s - lse + x)`` (minus ``P``, below
    float64's range for expm1), which is finite however large ``x`` grows as long as it stays below
    ``lse - s``, and honestly infinite past it. Scores ~1e9 apart (scale 7e4 on logits ~1e4) give
    exponents ~700 where ``P`` is 0, and ``P * exp(x)`` was NaN there: a NaN bound. 0 where hidden."""
    product = c.p * fn(x)
    log_p = torch.where(c.vis, c.s - c.lse[..., None], -math.inf)
    return torch.where(c.p > 0, product, torch.where(c.vis, torch.exp(log_p + x), 0.0))


def _lse_kernel(c: _Case, model: Model, phi: torch.Tensor, ranks: torch.Tensor) -> torch.Tensor:
    """LSE error bound of a contract-following kernel against exact attention (section 6)."""
    u, p = model.u_acc, c.p
    g = gamma(c.n_rows[:, None] + ranks, u)
    phi_l = torch.where(c.vis, phi + torch.where(g < 1, -torch.log1p(-torch.where(g < 1, g, 0.0)), math.inf), 0.0)
    up = torch.log(torch.where(c.rows, _p_times(c, torch.exp, phi_l).sum(dim=-1), 1.0))
    down = -torch.log(torch.where(c.rows, (p * torch.exp(-phi_l)).sum(dim=-1), 1.0))
    dlog = torch.maximum(up, down) + c.n_rows * model.eta_acc
    log_err = C_LOG * u * (c.lse - c.m + dlog) + LOG_ABS * u
    lse = dlog + log_err + 3 * u * (c.lse.abs() + dlog + log_err) + _merge_error(c, model)
    return torch.where(c.rows, lse, 0.0)


def _out_kernel(c: _Case, model: Model, phi: torch.Tensor) -> torch.Tensor:
    """Output error bound of a contract-following kernel against exact attention (sections 3-5)."""
    p, vis = c.p, c.vis.to(F64)
    z_low = torch.where(c.rows, (p * torch.exp(-phi)).sum(dim=-1), 1.0)[..., None]
    p_hat = _p_times(c, torch.exp, phi) / z_low + model.eta_acc * vis
    term_a = _centred(c, _p_times(c, torch.expm1, phi) / z_low)
    term_b = rounding_error(p_hat, model.u_cast, model.eta_cast) @ c.av
    # Underflow: of p or alpha (an absolute eta per key in numerator and l), and of each operation on
    # the accumulator (products, additions, rescaling multiplies, FA1's steps).
    term_u = model.eta_acc * (vis @ c.av + c.n_rows[:, None] * c.o.abs() + (3 * c.n_rows + 4)[:, None])
    pre = term_a + term_b + term_u
    # A kernel may merge partials (section 14): each term also passes its run's division and two roundings
    # a merge.
    steps = 3 * c.n_rows + 2 + (1 + 2 * _merges(c) if model.merges else 0)
    pre = pre + gamma(steps, model.u_dot)[:, None] * (p_hat @ c.av + c.o.abs() + pre)
    merge = _merge_error(c, model)[..., None]  # a common factor on every weight: the output is off by it
    pre = pre + merge * (c.o.abs() + pre)
    x = c.o.abs() + pre
    # a division, or a reciprocal and a multiply (and float8's v_descale)
    div = rounding_error(x, (2 + model.out_roundings) * model.u_acc, (1 + model.out_roundings) * model.eta_acc)
    out = pre + div + rounding_error(x + div, model.u_out, model.eta_out)
    return torch.where(c.rows[:, None], out, 0.0)


def _forward_reference(c: _Case, ranks: torch.Tensor):
    """(out, lse) error bounds of the float64 reference against exact attention (section 8)."""
    model = REFERENCE_MODEL
    u = model.u_acc
    lse = _lse_kernel(c, model, _phi(c, model, ranks), ranks)
    pi = _score_error(c, model) + lse[..., None] + u * (c.lse[..., None] - c.s) + C_EXP * u
    pi = torch.where(c.vis, pi, 0.0)
    eta = model.eta_acc * c.vis.to(F64)
    out = ((_p_times(c, torch.expm1, pi) + eta) @ c.av
           + gamma(c.n_rows + 1, u)[:, None] * ((_p_times(c, torch.exp, pi) + eta) @ c.av)
           + (2 * c.n_rows + 2)[:, None] * model.eta_acc)
    return torch.where(c.rows[:, None], out, 0.0), lse


def forward_bounds(ref: Reference, q, k, v, *, dtype: torch.dtype, model: Model | None = None):
    """Elementwise bounds on ``|out - ref.out|`` ``[B, Hq, Nq, Dv]`` and ``|lse - ref.lse|`` ``[B, Hq, Nq]``
    (float64) for a kernel that follows the contract with inputs of ``dtype``."""
    out_shape = (*q.shape[:3], v.shape[-1])
    if k.shape[2] == 0 and ref.sink is None:  # no keys: every row is fully masked, out = 0, lse = -inf exactly
        return torch.zeros(out_shape, dtype=F64, device=q.device), torch.zeros(q.shape[:3], dtype=F64, device=q.device)
    kk = _keys(ref, q, k, v)
    model = kernel_model(dtype) if model is None else model
    out_b = torch.zeros(out_shape, dtype=F64, device=q.device)
    lse_b = torch.zeros(q.shape[:3], dtype=F64, device=q.device)
    for chunk in ref.chunks():  # every term is row-wise: one chunk of rows at a time
        c = _case(ref, q, kk, chunk)
        ranks = _ranks_for(c, model)
        phi = _phi(c, model, ranks)
        out_r, lse_r = _forward_reference(c, ranks)
        rows = slice(chunk.r0, chunk.r1)
        out_b[:, :, rows] = SAFETY * (_out_kernel(c, model, phi) + out_r)
        lse_b[:, :, rows] = SAFETY * (_lse_kernel(c, model, phi, ranks) + lse_r)
    return out_b, lse_b


def _backward_terms(c: _Case, model: Model, *, dout_abs, lse_err, delta_err, dp_minus_delta, dp_abs, near_max,
                    ref_dq):
    """The dq error bound of one contract-following backward against exact gradients for the rows of
    ``c``, given its LSE and Delta errors against exact values (section 7), and this chunk's parts of
    the dK and dV sums over rows, per query head ``[B, Hq, Nk, D]``: ``(dq, (dk_err, dk_abs, dv_err,
    dv_abs))`` (:func:`_key_terms` finishes them once every chunk is summed)."""
    u, eta = model.u_acc, model.eta_acc
    vis = c.vis.to(F64)
    pi = (_score_error(c, model) + lse_err[..., None] + C_ARG * u * (c.lse[..., None] - c.s)
          + u * c.lse.abs()[..., None] + (C_EXP + 2) * u)
    pi = torch.where(c.vis, pi, 0.0)
    dp_err = _p_times(c, torch.expm1, pi) + model.eta_acc * vis
    p_hat = _p_times(c, torch.exp, pi) + model.eta_acc * vis
    e_dp = torch.where(c.vis, gamma(c.dv, model.u_dot) * (dout_abs @ c.av.transpose(-1, -2)) + 2 * c.dv * eta, 0.0)
    g, e_delta, chain = dp_minus_delta, delta_err[..., None], 0.0
    if model.autograd_eager:  # section 11
        e_dp = e_dp + torch.where(c.vis, rounding_error(dp_abs + e_dp, model.u_cast, model.eta_cast), 0.0)
        mag = torch.where(c.vis, p_hat * (dp_abs + e_dp), 0.0)
        e_delta = ((dp_err * dp_abs + p_hat * e_dp).sum(-1) + gamma(c.n_rows + 2, u) * mag.sum(-1)
                   + (2 * c.n_rows + 2) * eta)[..., None]
        chain = 6 * u * (mag + p_hat * mag.sum(-1, keepdim=True))
    x = p_hat * (g + e_dp + e_delta) * (1 + 2 * u)
    # dS is cast to the input dtype; with a softcap after the chain rule (section 13), so the cast is of
    # dS_raw, and its absolute error below the normal range is eta_in whatever 1 - t^2 is.
    cast = rounding_error(x, model.u_cast, model.eta_cast) if c.cap is None else 0.0
    ds_err = torch.where(c.vis, dp_err * g + p_hat * (e_dp + e_delta) + 2 * u * x + 2 * eta + cast + chain, 0.0)
    ds_abs = torch.where(c.vis, x + 2 * eta + cast + chain, 0.0)
    if model.autograd_eager:  # the row max's gradient, -sum_j dS_j, lands on the keys that may be the max
        m_grad = ds_err.sum(-1, keepdim=True) + gamma(c.n_rows + 2, u)[:, None] * ds_abs.sum(-1, keepdim=True)
        ds_err = ds_err + torch.where(near_max, m_grad, 0.0)
        ds_abs = ds_abs + torch.where(near_max, m_grad, 0.0)
    if c.cap is not None:  # dQ and dK take the gradient of the raw scores (section 13), cast after the chain
        ds_err, ds_abs = _softcap_chain(c, model, ds_err, ds_abs)
        cast = torch.where(c.vis, rounding_error(ds_abs, model.u_cast, model.eta_cast), 0.0)
        ds_err, ds_abs = ds_err + cast, ds_abs + cast
    sc = abs(c.scale)

    dq = (sc * (ds_err @ c.ak + gamma(c.n_rows + 3, model.u_dot)[:, None] * (ds_abs @ c.ak))
          + (3 * c.n_rows + 3)[:, None] * eta)
    dq = dq + rounding_error(ref_dq.abs() + dq, model.u_out, model.eta_out)

    p_cast = rounding_error(p_hat, model.u_cast, model.eta_cast)
    sums = (ds_err.transpose(-1, -2) @ c.aq, ds_abs.transpose(-1, -2) @ c.aq,
            (dp_err + p_cast).transpose(-1, -2) @ dout_abs, (p_hat + p_cast).transpose(-1, -2) @ dout_abs)
    if c.sink_abs is not None:  # the sink's dS (the last column), per row: for dsinks (section 15)
        sums = (*sums, (ds_err[..., -1], ds_abs[..., -1]))
    return dq, sums


def _key_terms(c: _Keys, model: Model, sums, *, ref_dk, ref_dv):
    """(dk, dv) error bounds (section 7) from the per-head sums over every row of
    :func:`_backward_terms`."""
    eta, sc = model.eta_acc, abs(c.scale)
    dk_err, dk_abs, dv_err, dv_abs = sums
    dk = sc * (reduce_group(dk_err, c.heads_kv)
               + gamma(c.group * c.n_keys + 3, model.u_dot)[:, None]
               * reduce_group(dk_abs, c.heads_kv)) + (3 * c.group * c.n_keys + 3)[:, None] * eta
    dk = dk + rounding_error(ref_dk.abs() + dk, model.u_out, model.eta_out)
    if model.autograd_eager:
        dk = dk + _per_head_rounding(c, model, sc * dk_abs)

    dv = (reduce_group(dv_err, c.heads_kv)
          + gamma(c.group * c.n_keys + 2, model.u_dot)[:, None] * reduce_group(dv_abs, c.heads_kv)
          + (2 * c.group * c.n_keys + 2)[:, None] * eta)
    dv = dv + rounding_error(ref_dv.abs() + dv, model.u_out, model.eta_out)
    if model.autograd_eager:
        dv = dv + _per_head_rounding(c, model, dv_abs)
    return dk, dv


def _per_head_rounding(c: _Keys, model: Model, per_head: torch.Tensor) -> torch.Tensor:
    """Autograd through ``expand_kv(k).to(float32)`` rounds each query head's dK/dV to the input dtype
    and then sums the group in it: a rounding per head and ``G - 1`` additions (section 11)."""
    if c.group == 1:
        return torch.zeros_like(reduce_group(per_head, c.heads_kv))
    rounded = reduce_group(rounding_error(per_head, model.u_out, model.eta_out), c.heads_kv)
    return rounded + gamma(c.group - 1, model.u_out) * (reduce_group(per_head, c.heads_kv) + rounded)


def backward_bounds(ref: Reference, q, k, v, *, dtype: torch.dtype, out: torch.Tensor,
                    model: Model | None = None):
    """Elementwise bounds on the errors of a contract-following backward against ``ref`` (computed with
    ``dout``): ``(dq [B, Hq, Nq, D], dk [B, Hkv, Nk, D], dv [B, Hkv, Nk, Dv], delta [B, Hq, Nq])``,
    float64, and with sinks ``dsinks [Hq]`` fifth. ``out`` is the kernel's own rounded forward output,
    from which it computes Delta."""
    if ref.dout is None:
        raise ValueError("backward_bounds: ref has no backward; compute it with attention(..., dout=dout)")
    if is_fp8(dtype):
        raise ValueError(f"backward_bounds: dtype={dtype} is a float8 format, which the contract takes in the "
                         "forward only (section 16)")
    if tuple(out.shape) != (*q.shape[:3], v.shape[-1]):
        raise ValueError(f"backward_bounds: out.shape={tuple(out.shape)}, but should be q's [B, Hq, Nq] and v's head "
                         f"dim: {(*q.shape[:3], v.shape[-1])}")
    if k.shape[2] == 0 and ref.sink is None:  # no keys: dq = 0, Delta = rowsum(dO * 0) = 0; dk, dv are empty
        zeros = torch.zeros(q.shape, dtype=F64, device=q.device)
        return (zeros, torch.zeros(k.shape, dtype=F64, device=q.device), torch.zeros(v.shape, dtype=F64, device=q.device),
                torch.zeros(q.shape[:3], dtype=F64, device=q.device))
    kk = _keys(ref, q, k, v)
    model = kernel_model(dtype) if model is None else model
    ref_model = REFERENCE_MODEL
    sinks = ref.sink is not None
    sink_k = sink_r = (0.0, 0.0)  # with sinks: [Hq] sums over batch and rows of the sink's dS error and size
    terms = kk.dv  # Delta = rowsum(dO * O): products and additions over v's head dim
    dq = torch.zeros(q.shape, dtype=F64, device=q.device)
    delta = torch.zeros(q.shape[:3], dtype=F64, device=q.device)
    k_sums = r_sums = None  # per-head dK and dV sums over the rows, added chunk by chunk
    for chunk in ref.chunks():
        c = _case(ref, q, kk, chunk)
        r = slice(chunk.r0, chunk.r1)
        ranks = _ranks_for(c, model)
        lse_k = _lse_kernel(c, model, _phi(c, model, ranks), ranks)
        out_r, lse_r = _forward_reference(c, ranks)
        rows = c.rows[:, None]
        do = torch.where(rows, ref.dout[:, :, r], 0.0)
        do_abs = do.abs()
        o_k = torch.where(rows, out[:, :, r].detach().to(F64), 0.0)
        diff = o_k - c.o
        measured = (do * diff).sum(-1).abs() + gamma(terms + 2, ref_model.u_acc) * (do_abs * diff.abs()).sum(-1)
        from_ref_out = (do_abs * out_r).sum(-1)
        # Delta: D products and D - 1 additions, each with an absolute eta for underflow.
        kernel_sum = gamma(terms, model.u_acc) * (do_abs * o_k.abs()).sum(-1) + 2 * terms * model.eta_acc
        ref_sum = gamma(terms, ref_model.u_acc) * (do_abs * c.o.abs()).sum(-1) + 2 * terms * ref_model.eta_acc
        dp = _column(chunk.dp, 0.0) if sinks else chunk.dp  # the sink's value is 0: dP_sink = 0
        g = torch.where(c.vis, (dp - ref.delta[:, :, r, None]).abs(), 0.0)
        dp_abs = torch.where(c.vis, dp.abs(), 0.0)
        err = _score_error(c, model)
        near_max = c.vis & (c.s >= (c.m - 2 * err.amax(dim=-1))[..., None])
        extra = dict(dp_minus_delta=g, dp_abs=dp_abs, near_max=near_max, ref_dq=ref.dq[:, :, r])
        dq_k, sums_k = _backward_terms(c, model, dout_abs=do_abs, lse_err=lse_k,
                                       delta_err=measured + from_ref_out + kernel_sum, **extra)
        dq_r, sums_r = _backward_terms(c, ref_model, dout_abs=do_abs, lse_err=lse_r,
                                       delta_err=from_ref_out + ref_sum, **extra)
        dq[:, :, r] = torch.where(rows, SAFETY * (dq_k + dq_r), 0.0)
        # Against ref.delta (from the same reference output): the reference output's error cancels.
        delta[:, :, r] = torch.where(c.rows, SAFETY * (measured + kernel_sum + ref_sum), 0.0)
        if sinks:  # the sink is the last key: its dS terms go to dsinks, not into dK and dV
            sink_k = tuple(a + b.sum(dim=(0, 2)) for a, b in zip(sink_k, sums_k[4]))
            sink_r = tuple(a + b.sum(dim=(0, 2)) for a, b in zip(sink_r, sums_r[4]))
            sums_k, sums_r = (tuple(x[:, :, :-1] for x in sums[:4]) for sums in (sums_k, sums_r))
        k_sums = sums_k[:4] if k_sums is None else tuple(a + b for a, b in zip(k_sums, sums_k))
        r_sums = sums_r[:4] if r_sums is None else tuple(a + b for a, b in zip(r_sums, sums_r))
    if k_sums is None:  # no query rows: nothing sums into dK and dV
        key_zeros, value_zeros = (torch.zeros(t.shape, dtype=F64, device=q.device) for t in (kk.ak, kk.av))
        k_sums = r_sums = (key_zeros, key_zeros, value_zeros, value_zeros)
    dk_k, dv_k = _key_terms(kk, model, k_sums, ref_dk=ref.dk, ref_dv=ref.dv)
    dk_r, dv_r = _key_terms(kk, ref_model, r_sums, ref_dk=ref.dk, ref_dv=ref.dv)
    keys = kk.keys[:, None]
    dk = torch.where(keys, SAFETY * (dk_k + dk_r), 0.0)
    dv = torch.where(keys, SAFETY * (dv_k + dv_r), 0.0)
    if not sinks:
        return dq, dk, dv, delta
    rows = ref.lse.numel() // ref.lse.shape[1]  # B * Nq terms per head
    return dq, dk, dv, delta, SAFETY * (_sink_terms(sink_k, model, rows, ref.dsinks)
                                        + _sink_terms(sink_r, ref_model, rows, ref.dsinks))


def _sink_terms(sums, model: Model, terms: int, ref_dsinks: torch.Tensor) -> torch.Tensor:
    """Section 15: ``dt_h = sum over batch and rows of the sink's dS``: the sum of their errors, ``gamma``
    of the ``terms`` additions on their magnitudes, then the rounding of the float32 result."""
    err, size = sums
    total = err + gamma(terms + 1, model.u_acc) * size + (terms + 1) * model.eta_acc
    return total + rounding_error(ref_dsinks.abs() + total, model.u_acc, model.eta_acc)
