"""elsa_ds/loss.py: the chunked next-token loss is transformers' loss, value and gradient, in any chunking."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from elsa_ds.loss import next_token_loss
from elsa_ds.settings.config import DEMO_MODEL_DIR


def reference(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """transformers' arithmetic: the logits upcast whole, cross-entropy over every position but the last."""
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 1000])
def test_value_and_gradient_are_the_whole_upcast_loss_in_any_chunking(dtype, rows):
    torch.manual_seed(0)
    vocab = 101
    logits = (3 * torch.randn(3, 17, vocab)).to(dtype)
    ids = torch.randint(0, vocab, (3, 17))
    mine, theirs = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    loss = next_token_loss(mine, ids, row_elements=rows * vocab)
    (0.25 * loss).backward()  # a scaled loss, as DeepSpeed's 1 / gradient accumulation scales it
    (0.25 * reference(theirs, ids)).backward()
    assert loss.dtype == torch.float32 and float(loss.detach()) == pytest.approx(float(reference(logits, ids)), rel=1e-6)
    assert mine.grad.dtype == dtype
    tol = 1e-8 if dtype == torch.float32 else 2e-3 * float(theirs.grad.abs().max())  # bf16: one rounding of the same fp32
    assert float((mine.grad.float() - theirs.grad.float()).abs().max()) <= tol
    assert float(mine.grad[:, -1].abs().max()) == 0.0  # a sequence's last position predicts nothing
    assert torch.equal(logits, mine.detach())  # the logits themselves untouched (fp32: no in-place softmax on them)


def test_on_a_model_it_is_the_models_own_loss_and_gradient():
    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    theirs = model(input_ids=ids, labels=ids).loss
    theirs.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    mine = next_token_loss(model(input_ids=ids, use_cache=False).logits, ids, row_elements=7 * model.config.vocab_size)
    mine.backward()
    assert float(mine) == pytest.approx(float(theirs), rel=1e-6)
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, grads[name], rtol=1e-4, atol=1e-7), name


def test_it_keeps_no_fp32_copy_for_the_backward_and_refuses_bad_shapes():
    logits = torch.randn(2, 9, 50, dtype=torch.bfloat16, requires_grad=True)
    loss = next_token_loss(logits, torch.randint(0, 50, (2, 9)), row_elements=100)
    saved = loss.grad_fn.saved_tensors
    assert [t.dtype for t in saved] == [torch.bfloat16] and saved[0].numel() == logits.numel()
    with torch.no_grad():  # evaluation: no gradient made at all
        ids = torch.randint(0, 50, (2, 9))
        assert next_token_loss(logits, ids).grad_fn is None
        assert float(next_token_loss(logits, ids.int())) == float(next_token_loss(logits, ids))  # int32 ids as int64
    with pytest.raises(ValueError, match="logits \\[batch, seq, vocab\\]"):
        next_token_loss(logits[0], torch.randint(0, 50, (9,)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 4, 1000])
def test_evaluation_nll_is_the_whole_upcast_sum_in_any_chunking(dtype, rows):
    """elsa_ds.evaluation.perplexity.token_nll: the summed fp32 NLL that perplexity reports, a chunk of rows at a time."""
    from elsa_ds.evaluation.perplexity import token_nll

    torch.manual_seed(2)
    vocab = 97
    logits = (4 * torch.randn(3, 13, vocab)).to(dtype)
    ids = torch.randint(0, vocab, (3, 13), dtype=torch.int32)
    whole = F.cross_entropy(logits[:, :-1].float().reshape(-1, vocab), ids[:, 1:].reshape(-1).long(), reduction="sum")
    nll, count = token_nll(logits, ids, row_elements=rows * vocab)
    assert count == 3 * 12
    assert nll == pytest.approx(float(whole), rel=1e-6)
    assert token_nll(logits, ids)[0] == pytest.approx(nll, rel=1e-6)  # the default chunk: one per sequence here



def _torch_scale(grad, scale):
    """elsa_ds.loss_kernel.scale_'s contract in torch: the fp32 product rounded once."""
    return grad.copy_((grad.float() * scale.float()).to(grad.dtype))


def _torch_rows(fault: float = 1.0):
    """elsa_ds.loss_kernel.cross_entropy_rows's contract in torch (for the dispatch's logic without triton), its gradient
    scaled by ``fault``."""
    def rows(logits, targets, inv_count=None, grad=None, block=None):
        x = logits.float()
        losses = F.cross_entropy(x, targets.clamp(min=0), reduction="none") * (targets >= 0)
        if grad is not None:
            g = torch.softmax(x, -1)
            g[torch.arange(len(targets)), targets.clamp(min=0)] -= 1
            grad.copy_(g * ((targets >= 0).float() * inv_count * fault)[:, None])
        return losses
    return rows


def test_the_fused_path_is_taken_only_where_it_agreed_with_the_chunks(monkeypatch, caplog):
    """loss_path: CPU tensors (and ELSA_DS_LOSS=chunked) take the chunks; a kernel that drops the last 5 logits of a
    row, or whose gradient is 1 % off, or which raises, is refused once with a warning naming why (a correct one
    passes); ELSA_DS_LOSS=fused where the kernel cannot run, and an unknown value, are one-line errors."""
    from elsa_ds import loss as L
    from elsa_ds import loss_kernel
    from elsa_ds.errors import ElsaError

    def dropped(logits, targets, inv_count=None, grad=None, block=None):  # the tail block's mask wrong by 5 entries
        keep = logits.shape[1] - 5
        out = _torch_rows()(logits[:, :keep], targets.clamp(max=keep - 1), inv_count, None if grad is None else grad[:, :keep])
        if grad is not None:
            grad[:, keep:] = 0
        return out

    assert L.loss_path(torch.zeros(1, 2, 3)) == "chunked"
    monkeypatch.setattr(loss_kernel, "unavailable", lambda device: None)
    for kernel, agrees in ((_torch_rows(), True), (_torch_rows(1.01), False), (dropped, False), (None, False)):
        L.fused_disagrees.cache_clear()
        monkeypatch.setattr(loss_kernel, "cross_entropy_rows", kernel)  # None: the call raises TypeError
        monkeypatch.setattr(loss_kernel, "scale_", _torch_scale)
        caplog.clear()
        with caplog.at_level("WARNING", logger="elsa_ds"):
            reason = L.fused_disagrees("cpu", torch.bfloat16)
        assert (reason is None) == agrees, reason
        if not agrees:
            assert ("past its tolerance" in reason) if kernel else ("failed" in reason and "TypeError" in reason)
            assert "runs as torch chunks" in caplog.text and reason in caplog.text
    L.fused_disagrees.cache_clear()
    monkeypatch.setenv(L.LOSS_ENV, "fused")
    with pytest.raises(ElsaError, match="ELSA_DS_LOSS=fused, but the Triton loss cannot run here: logits on cpu"):
        L.loss_path(torch.zeros(1, 2, 3))
    monkeypatch.setenv(L.LOSS_ENV, "triton")
    with pytest.raises(ElsaError, match="ELSA_DS_LOSS='triton': expected one of auto, chunked, fused"):
        L.loss_path(torch.zeros(1, 2, 3))


def test_the_first_fused_loss_is_held_to_the_chunks_at_its_own_shape(monkeypatch, caplog):
    """The first fused loss of a process on a device and dtype is compared with the chunks at its real shape (what the
    small self-check cannot show: an offset past int32, a cut grid): a kernel whose last row's gradient is wrong there
    (or whose value is) is refused with a warning, and that call's value and gradient are the chunks'; later calls take
    the chunks (loss_path), the report says so; ELSA_DS_LOSS=fused makes it an error; a right kernel passes once."""
    from elsa_ds import loss as L
    from elsa_ds import loss_kernel
    from elsa_ds.errors import ElsaError

    def last_row_wrong(logits, targets, inv_count=None, grad=None, block=None):
        out = _torch_rows()(logits, targets, inv_count, grad)
        if grad is not None:
            grad[-2] = 0  # the last row that predicts: as a row past an overflowing offset would be
        return out

    def value_wrong(logits, targets, inv_count=None, grad=None, block=None):
        return _torch_rows()(logits, targets, inv_count, grad) * 1.01

    gen = torch.Generator().manual_seed(0)
    logits = (4 * torch.randn(3, 7, 50, generator=gen)).to(torch.bfloat16)
    ids = torch.randint(0, 50, (3, 7), generator=gen)
    targets = L.shifted_targets(ids).reshape(-1)

    def value_and_grad():
        x = logits.clone().requires_grad_()
        value = L._FusedNextToken.apply(x, targets)
        value.backward()
        return float(value), x.grad.float()

    x = logits.clone().requires_grad_()
    next_token_loss(x, ids).backward()  # the chunks, on CPU
    want, want_grad = float(next_token_loss(logits, ids)), x.grad.float()
    monkeypatch.setattr(L, "_AT_SCALE", {})  # not a check: no gradient, or NaN logits (theirs, not the kernel's fault)
    flat, count = logits.reshape(-1, 50), torch.tensor(18.0)
    nan = flat.clone()
    nan[3, 7] = float("nan")
    assert L._checked_at_scale(flat, targets, count, torch.tensor(want), None) is None
    assert L._checked_at_scale(nan, targets, count, torch.tensor(float("nan")), torch.zeros_like(flat)) is None
    assert L._AT_SCALE == {}
    for kernel, agrees in ((_torch_rows(), True), (last_row_wrong, False), (value_wrong, False)):
        monkeypatch.setattr(L, "_AT_SCALE", {})
        monkeypatch.setattr(L, "_TAKEN", {"fused"})
        monkeypatch.setattr(loss_kernel, "cross_entropy_rows", kernel)
        monkeypatch.setattr(loss_kernel, "scale_", _torch_scale if agrees else None)  # refused: the chunks' backward
        caplog.clear()
        with caplog.at_level("WARNING", logger="elsa_ds"):
            value, grad = value_and_grad()
        reason = L._AT_SCALE[("cpu", torch.bfloat16)]
        assert (reason is None) == agrees, reason
        assert value == pytest.approx(want, rel=1e-5) and torch.allclose(grad, want_grad, rtol=1e-2, atol=1e-6)
        if not agrees:
            assert "the first fused loss of this process" in reason and "(21, 50)" in reason and "bfloat16" in reason
            assert ("rows [0, 10, 19, 20]" in reason) if kernel is last_row_wrong else ("its loss" in reason)
            assert "runs as torch chunks on cpu from now on" in caplog.text and L.taken() == "chunked"
            assert L._checked_at_scale(logits.reshape(-1, 50), targets, torch.tensor(18.0), torch.tensor(0.0), None) is None
            monkeypatch.setenv(L.LOSS_ENV, "fused")
            monkeypatch.setattr(L, "_AT_SCALE", {})
            with pytest.raises(ElsaError, match="ELSA_DS_LOSS=fused, but the Triton loss cannot run here: .*first fused"):
                value_and_grad()
            monkeypatch.delenv(L.LOSS_ENV)
        else:
            assert L.taken() == "fused" and "runs as torch chunks" not in caplog.text


def test_the_fused_backwards_scale_is_held_to_torch_at_both_ends_once(monkeypatch):
    """The fused loss's backward scales its gradient by a Triton kernel: the first real backward on a device and dtype
    (not the small self-check's) holds its first and last predicting rows (the highest addresses written) to torch's
    product, one rounding allowed; a kernel that leaves the last predicting row unscaled is an error naming the way out
    (ELSA_DS_LOSS=chunked), never a silent gradient; checked once."""
    from elsa_ds import loss as L
    from elsa_ds import loss_kernel
    from elsa_ds.errors import ElsaError

    gen = torch.Generator().manual_seed(1)
    logits = (4 * torch.randn(3, 7, 50, generator=gen)).to(torch.bfloat16)
    ids = torch.randint(0, 50, (3, 7), generator=gen)
    targets = L.shifted_targets(ids).reshape(-1)

    def last_predicting_unscaled(grad, scale):  # row 19 of 21 (row 20 predicts nothing: zero either way)
        _torch_scale(grad[:19], scale)
        return _torch_scale(grad[20:], scale)

    def backward(at_scale=True):
        x = logits.clone().requires_grad_()
        (0.5 * L._FusedNextToken.apply(x, targets, at_scale)).backward()
        return x.grad

    x = logits.clone().requires_grad_()
    (0.5 * next_token_loss(x, ids)).backward()  # the chunks, on CPU
    monkeypatch.setattr(loss_kernel, "cross_entropy_rows", _torch_rows())
    monkeypatch.setattr(L, "_AT_SCALE", {})
    for kernel, fails in ((last_predicting_unscaled, True), (_torch_scale, False)):
        monkeypatch.setattr(L, "_SCALE_CHECKED", set())
        monkeypatch.setattr(loss_kernel, "scale_", kernel)
        backward(at_scale=False)  # the self-check's problem spends no check
        assert L._SCALE_CHECKED == set()
        if fails:
            with pytest.raises(ElsaError, match=r"gradient scale .* on cpu in bfloat16 \(rows \[0, 19\]\): run with "
                                                r"ELSA_DS_LOSS=chunked"):
                backward()
        else:
            assert torch.allclose(backward().float(), x.grad.float(), rtol=1e-2, atol=1e-6)
            assert L._SCALE_CHECKED == {("cpu", torch.bfloat16)}
    monkeypatch.setattr(loss_kernel, "scale_", last_predicting_unscaled)  # checked once: a later call is not held up
    backward()


def test_a_second_backward_through_one_loss_is_refused_and_leaves_the_first_gradient(monkeypatch):
    """Both losses scale their saved gradient in place and hand it on: a second backward of one graph
    (``retain_graph=True``) would scale the first one's result again; it is refused, the first gradient stands."""
    from elsa_ds import loss as L
    from elsa_ds import loss_kernel
    from elsa_ds.errors import ElsaError

    gen = torch.Generator().manual_seed(3)
    logits = (3 * torch.randn(2, 6, 40, generator=gen)).to(torch.bfloat16)
    ids = torch.randint(0, 40, (2, 6), generator=gen)
    x = logits.clone().requires_grad_()
    reference(x, ids).backward()
    want = x.grad.float()
    monkeypatch.setattr(loss_kernel, "cross_entropy_rows", _torch_rows())
    monkeypatch.setattr(loss_kernel, "scale_", _torch_scale)
    monkeypatch.setattr(L, "_AT_SCALE", {})
    fused = lambda v: L._FusedNextToken.apply(v, L.shifted_targets(ids).reshape(-1), False)  # noqa: E731
    for loss_of in (lambda v: next_token_loss(v, ids), fused):
        x = logits.clone().requires_grad_()
        loss = 2 * loss_of(x)
        loss.backward(retain_graph=True)
        first = x.grad.clone()
        assert torch.allclose(first.float(), 2 * want, rtol=2e-2, atol=1e-4)
        with pytest.raises(ElsaError, match=r"second backward .* compute the loss again"):
            loss.backward()
        assert torch.equal(x.grad, first)
