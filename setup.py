"""The package build's one step beyond pyproject.toml: the C kernels (pixeltriage/kernels/native), compiled with the
machine's C compiler (`CC`, else cc, gcc or clang; no torch headers) once for every build `variants.all_builds`
lists for this architecture (on x86-64 four instruction-set levels, the portable build, the emulated one and the
CPU probe), as plain shared libraries ctypes loads, into pixeltriage/kernels/native/prebuilt/ with a manifest of
what each was built from. `pip install .` and `pip wheel .` build them into the package (the wheel is then this
platform's); an editable install builds them in place, in the source tree. Linux only: elsewhere nothing is built.
"""
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CompileError

ROOT = Path(__file__).resolve().parent
NATIVE = ROOT / "pixeltriage" / "kernels" / "native"
PACKAGE = "pixeltriage.kernels.native.prebuilt"


def _module(name: str):
    """kernels/native/<name>.py on its own (standard library only): the package imports torch, which the build
    environment does not have."""
    spec = importlib.util.spec_from_file_location(f"_pixeltriage_native_{name}", NATIVE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


abi, variants = _module("abi"), _module("variants")
BUILDS = {v.name.replace("-", "_"): v for v in variants.all_builds()} if sys.platform == "linux" else {}


def _compiler() -> str:
    cc = os.environ.get("CC") or next(filter(None, map(shutil.which, ("cc", "gcc", "clang"))), None)
    if not cc:
        raise CompileError("pixeltriage compiles its C kernels when it is built: no C compiler found (set CC to one "
                           "executable)")
    return shutil.which(cc) or cc


class BuildNative(build_ext):
    """Each extension a build of `variants`, compiled by `variants.compile` with abi.py's checks beside its sources;
    then the manifest (`variants.MANIFEST`) beside the libraries."""

    def initialize_options(self):
        super().initialize_options()
        self._openmp: dict[str, bool] = {}             # per build, whether it has OpenMP (the manifest's)

    def finalize_options(self):
        super().finalize_options()
        if self.parallel is None:
            self.parallel = True                       # a build per CPU at a time

    def get_ext_filename(self, fullname: str) -> str:
        package, _, name = fullname.rpartition(".")
        filename = BUILDS[name].filename
        return os.path.join(*package.split("."), filename) if package else filename

    def build_extension(self, ext: Extension) -> None:
        build = BUILDS[ext.name.rpartition(".")[2]]
        names = None if build.name != "probe" else ("pt_build_features", "pt_bf16_engines", "pt_cpu_features")
        out = Path(self.get_ext_fullpath(ext.name))
        print(f"building the C kernels ({build.name}) -> {out}", flush=True)
        try:
            openmp = variants.compile(_compiler(), build, out, abi.load().check_source(names))
        except RuntimeError as e:
            raise CompileError(f"the C kernels ({build.name}) did not build:\n{e}") from None
        if not openmp:
            print(f"warning: the C kernels ({build.name}) built without OpenMP: one thread", flush=True)
        self._openmp[build.name] = openmp

    def copy_extensions_to_source(self):
        self._manifest_paths()[1].parent.mkdir(parents=True, exist_ok=True)       # prebuilt/ is not in the tree
        super().copy_extensions_to_source()

    def _manifest_paths(self) -> tuple[Path, Path]:
        """The manifest in the build directory, and in the source tree (where an editable install puts it)."""
        regular = Path(self.build_lib, *PACKAGE.split("."), variants.MANIFEST)
        build_py = self.get_finalized_command("build_py")
        return regular, Path(build_py.get_package_dir(PACKAGE), variants.MANIFEST)

    def run(self):
        super().run()
        if not BUILDS:
            return
        cc = _compiler()
        manifest = {"sources": variants.sources_key(), "compiler": variants.compiler_id(cc),
                    "machine": variants.machine(),
                    "builds": {b.name: {"file": b.filename, "flags": list(b.flags), "openmp": self._openmp[b.name]}
                               for b in BUILDS.values()}}
        regular, inplace = self._manifest_paths()
        for path in (regular, inplace) if self.inplace else (regular,):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(manifest, indent=1) + "\n")

    def get_outputs(self):
        return [*super().get_outputs(), str(self._manifest_paths()[1 if self.inplace else 0])] if BUILDS else []

    def get_output_mapping(self):
        mapping = super().get_output_mapping()
        if BUILDS and self.inplace:
            regular, inplace = self._manifest_paths()
            mapping[str(regular)] = str(inplace)
        return mapping


setup(
    ext_modules=[Extension(f"{PACKAGE}.{name}", sources=[str(p.relative_to(ROOT)) for p in build.sources])
                 for name, build in BUILDS.items()],
    cmdclass={"build_ext": BuildNative},
)
