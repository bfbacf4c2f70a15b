from __future__ import annotations

import gguf
import pytest

from pipeline.errors import InvalidReferenceError, InvalidSpecError, UnknownQuantTypeError
from pipeline.plan import variants_from_flags
from pipeline.specs import AWQSpec, EXL2Spec, GGUFSpec, GGUFType, Ref, parse_gguf_type


def test_gguf_types_come_from_gguf_py_and_match_llama_cpp() -> None:
    import llama_cpp

    for member in GGUFType:
        prefix = "ALL" if member.name == "F32" else "MOSTLY"
        assert gguf.LlamaFileType[f"{prefix}_{member.name}"].value == member.value
        constant = f"LLAMA_FTYPE_{prefix}_{member.name}"
        if hasattr(llama_cpp, constant):  # gguf-py may know types this llama.cpp build lacks, never the reverse
            assert getattr(llama_cpp, constant) == member.value, constant
    assert {"Q8_0", "Q6_K", "Q5_K_M", "Q5_K_S", "Q4_K_M", "Q4_K_S", "Q4_0", "Q3_K_M", "Q3_K_L", "Q2_K", "BF16",
            "F16", "IQ4_XS"} <= {m.name for m in GGUFType}


def test_unknown_gguf_type_lists_known_ones() -> None:
    with pytest.raises(UnknownQuantTypeError) as info:
        parse_gguf_type("Q9_K_XL")
    assert "Q4_K_M" in info.value.known
    assert "Q4_K_M" in str(info.value) and "Q9_K_XL" in str(info.value)
    assert isinstance(info.value, ValueError)


def test_gguf_type_names_are_case_insensitive() -> None:
    assert GGUFSpec(type="q4_k_m").type == "Q4_K_M"
    assert GGUFSpec(type="Q4_K_M", imatrix=True).name == "i1-Q4_K_M"


def test_variant_names() -> None:
    assert EXL2Spec(bpw=4.0).name == "EXL2-4.0bpw"
    assert EXL2Spec(bpw=4.25).name == "EXL2-4.25bpw"
    assert AWQSpec().name == "AWQ-W4-G128-asym"


def test_variants_from_flags_validates_and_dedups() -> None:
    specs = variants_from_flags(gguf="Q8_0, q8_0,Q4_K_M", exl2="4.0")
    assert [s.name for s in specs] == ["Q8_0", "Q4_K_M", "EXL2-4.0bpw"]
    with pytest.raises(UnknownQuantTypeError):
        variants_from_flags(gguf="Q8_0,BOGUS")
    with pytest.raises(InvalidSpecError):
        variants_from_flags(exl2="9.5")
    with pytest.raises(InvalidSpecError):
        variants_from_flags()


@pytest.mark.parametrize(("text", "model", "variant", "version", "alias"), [
    ("demo/Q4_K_M", "demo", "Q4_K_M", None, None),
    ("demo/Q4_K_M@3", "demo", "Q4_K_M", 3, None),
    ("org/model/i1-Q4_K_M@production", "org/model", "i1-Q4_K_M", None, "production"),
])
def test_ref_parse(text: str, model: str, variant: str, version: int | None, alias: str | None) -> None:
    ref = Ref.parse(text)
    assert (ref.model, ref.variant, ref.version, ref.alias) == (model, variant, version, alias)
    assert str(ref) == text


@pytest.mark.parametrize("bad", ["demo", "/Q4", "demo/", "demo/Q4@", "../x/y", "demo/Q4@a/b", "a/b/c/d"])
def test_ref_parse_rejects(bad: str) -> None:
    with pytest.raises(InvalidReferenceError):
        Ref.parse(bad)
