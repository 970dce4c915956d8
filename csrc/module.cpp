// pybind11 bindings: moe_rl._C (routing-record codec and store). No torch linkage: everything
// crosses the boundary as numpy arrays, and hot loops run with the GIL released.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <string>
#include <system_error>

#include "bitpack.h"
#include "crc32c.h"
#include "store.h"

void bind_exact(pybind11::module_& m);  // exact_bind.cpp: the batch-invariant kernels

namespace py = pybind11;
using namespace moe_rl;

namespace {

void require_c_contiguous(const py::array& a, const char* what) {
  if (!(a.flags() & py::array::c_style))
    throw py::value_error(std::string(what) + " must be C-contiguous");
}

// Calls f(static_cast<const T*>(ptr)) with T the array's integer element type.
template <typename F>
auto with_int_type(const py::array& a, const char* what, F&& f) {
  const char kind = a.dtype().kind();
  const auto size = a.dtype().itemsize();
  const void* p = a.data();
  if (kind == 'i') {
    switch (size) {
      case 1: return f(static_cast<const int8_t*>(p));
      case 2: return f(static_cast<const int16_t*>(p));
      case 4: return f(static_cast<const int32_t*>(p));
      case 8: return f(static_cast<const int64_t*>(p));
    }
  } else if (kind == 'u') {
    switch (size) {
      case 1: return f(static_cast<const uint8_t*>(p));
      case 2: return f(static_cast<const uint16_t*>(p));
      case 4: return f(static_cast<const uint32_t*>(p));
      case 8: return f(static_cast<const uint64_t*>(p));
    }
  }
  throw py::value_error(std::string(what) + " must have an integer dtype, got " +
                        std::string(py::str(a.dtype())));
}

bool is_int64_out(const py::array& out) {
  if (out.dtype().kind() == 'i' && out.dtype().itemsize() == 8) return true;
  if (out.dtype().kind() == 'i' && out.dtype().itemsize() == 4) return false;
  throw py::value_error("output dtype must be int32 or int64, got " +
                        std::string(py::str(out.dtype())));
}

py::dtype out_dtype(const std::string& name) {
  if (name == "int64") return py::dtype::of<int64_t>();
  if (name == "int32") return py::dtype::of<int32_t>();
  throw py::value_error("dtype must be 'int32' or 'int64', got '" + name + "'");
}

py::array_t<uint8_t> py_pack(const py::array& ids, int64_t num_experts) {
  require_c_contiguous(ids, "ids");
  const int bits = bits_for(num_experts);
  const size_t n = size_t(ids.size());
  py::array_t<uint8_t> out(py::ssize_t(packed_bytes(n, bits)));
  uint8_t* o = out.mutable_data();
  const uint64_t mx = with_int_type(ids, "ids", [&](auto* p) {
    py::gil_scoped_release nogil;
    return pack(p, n, bits, o);
  });
  if (mx >= uint64_t(num_experts)) {
    const int64_t i = with_int_type(ids, "ids", [&](auto* p) {
      return first_out_of_range(p, n, num_experts);
    });
    throw py::value_error("id at flat index " + std::to_string(i) +
                          " is out of range for num_experts=" + std::to_string(num_experts));
  }
  return out;
}

py::array py_unpack(const py::array_t<uint8_t, py::array::c_style>& buf, size_t n,
                    int64_t num_experts, const std::string& dtype, size_t first,
                    py::object out_obj) {
  const int bits = bits_for(num_experts);
  py::array out = out_obj.is_none() ? py::array(out_dtype(dtype), py::ssize_t(n))
                                    : out_obj.cast<py::array>();
  require_c_contiguous(out, "out");
  if (size_t(out.size()) != n) throw py::value_error("out has the wrong number of elements");
  if (packed_bytes(first + n, bits) > size_t(buf.size()))
    throw py::value_error("packed buffer too short for the requested ids");
  const uint8_t* in = buf.data();
  const size_t nbytes = size_t(buf.size());
  const bool i64 = is_int64_out(out);
  void* o = out.mutable_data();
  {
    py::gil_scoped_release nogil;
    if (i64)
      unpack(in, nbytes, first, n, bits, static_cast<int64_t*>(o));
    else
      unpack(in, nbytes, first, n, bits, static_cast<int32_t*>(o));
  }
  return out;
}

void check_record_shape(const Store& s, const py::array& ids) {
  if (ids.ndim() != 3 || ids.shape(1) != s.num_layers() || ids.shape(2) != s.top_k())
    throw py::value_error("ids must have shape [tokens, " + std::to_string(s.num_layers()) + ", " +
                          std::to_string(s.top_k()) + "]");
  require_c_contiguous(ids, "ids");
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "moe-rl routing-replay log: bit-packing codec, CRC32C and the segment store; batch-invariant kernels";
  bind_exact(m);
  {
    const uint16_t probe = 1;
    uint8_t first;
    std::memcpy(&first, &probe, 1);
    if (first != 1) throw std::runtime_error("moe_rl._C supports little-endian hosts only");
  }

  static py::exception<CorruptRecord> corrupt_exc(m, "CorruptRecordError", PyExc_RuntimeError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const CorruptRecord& e) {
      py::set_error(corrupt_exc, e.what());
    } catch (const NotFound& e) {
      py::set_error(PyExc_KeyError, py::str(e.what()));
    } catch (const std::system_error& e) {
      py::set_error(PyExc_OSError, e.what());
    }
  });

  m.def("bits_for", &bits_for, py::arg("num_experts"),
        "ceil(log2(num_experts)), at least 1: bits per packed id");
  m.def("packed_bytes", &packed_bytes, py::arg("n"), py::arg("bits"));
  m.def("pack", &py_pack, py::arg("ids"), py::arg("num_experts"),
        "Bit-pack a C-contiguous integer array (any int dtype) into uint8; ValueError if an id "
        "is outside [0, num_experts).");
  m.def("unpack", &py_unpack, py::arg("buf"), py::arg("n"), py::arg("num_experts"),
        py::arg("dtype") = "int64", py::arg("first") = 0, py::arg("out") = py::none(),
        "Decode ids [first, first+n) of a packed stream into a flat int32/int64 array.");
  m.def(
      "crc32c",
      [](py::buffer data, uint32_t crc) {
        py::buffer_info info = data.request();
        const size_t n = size_t(info.size) * size_t(info.itemsize);
        py::gil_scoped_release nogil;
        return crc32c(crc, info.ptr, n);
      },
      py::arg("data"), py::arg("crc") = 0u);
  m.def(
      "first_duplicate_row",
      [](const py::array& ids, size_t k) {
        require_c_contiguous(ids, "ids");
        if (k == 0 || ids.size() % k) throw py::value_error("size not a multiple of k");
        const size_t rows = size_t(ids.size()) / k;
        return with_int_type(ids, "ids", [&](auto* p) {
          py::gil_scoped_release nogil;
          return first_duplicate_row(p, rows, k);
        });
      },
      py::arg("ids"), py::arg("k"), "First row of k ids that repeats an id, or -1.");
  m.def(
      "first_out_of_range",
      [](const py::array& ids, int64_t bound) {
        require_c_contiguous(ids, "ids");
        return with_int_type(ids, "ids", [&](auto* p) {
          py::gil_scoped_release nogil;
          return first_out_of_range(p, size_t(ids.size()), bound);
        });
      },
      py::arg("ids"), py::arg("bound"), "First flat index with id < 0 or >= bound, or -1.");

  py::class_<Store>(m, "Store")
      .def(py::init<const std::string&, int, int, int, bool, uint64_t>(), py::arg("path"),
           py::arg("num_layers"), py::arg("top_k"), py::arg("num_experts"), py::arg("writable"),
           py::arg("segment_bytes") = uint64_t(1) << 30)
      .def_property_readonly("num_layers", &Store::num_layers)
      .def_property_readonly("top_k", &Store::top_k)
      .def_property_readonly("num_experts", &Store::num_experts)
      .def_property_readonly("bits", &Store::bits)
      .def_property_readonly("writable", &Store::writable)
      .def_property_readonly("closed", &Store::closed)
      .def(
          "append",
          [](Store& s, const std::string& uid, const py::array& ids,
             const std::vector<int64_t>& versions, bool check_duplicates) {
            check_record_shape(s, ids);
            const size_t tokens = size_t(ids.shape(0));
            with_int_type(ids, "ids", [&](auto* p) {
              py::gil_scoped_release nogil;
              s.append(uid, p, tokens, versions, check_duplicates);
              return 0;
            });
          },
          py::arg("uid"), py::arg("ids"), py::arg("versions"), py::arg("check_duplicates") = true)
      .def(
          "set_after_record_hook",
          [](Store& s, py::object fn) {
            if (fn.is_none()) {
              s.set_after_record_hook(nullptr);
              return;
            }
            // append runs without the GIL: take it to call fn, and to drop the last reference
            std::shared_ptr<py::object> f(new py::object(std::move(fn)), [](py::object* o) {
              py::gil_scoped_acquire gil;
              delete o;
            });
            s.set_after_record_hook([f] {
              py::gil_scoped_acquire gil;
              (*f)();
            });
          },
          py::arg("fn"),
          "Fault injection: fn() runs after each record is written, before its index entry.")
      .def(
          "read",
          [](Store& s, const std::string& uid, const std::string& dtype) {
            const RecordInfo info = s.info(uid);
            py::array out(out_dtype(dtype), std::vector<py::ssize_t>{py::ssize_t(info.num_tokens),
                                                                     s.num_layers(), s.top_k()});
            const bool i64 = is_int64_out(out);
            void* o = out.mutable_data();
            py::gil_scoped_release nogil;
            if (i64)
              s.read(uid, static_cast<int64_t*>(o), 0, info.num_tokens, false, 0, 0);
            else
              s.read(uid, static_cast<int32_t*>(o), 0, info.num_tokens, false, 0, 0);
            return out;
          },
          py::arg("uid"), py::arg("dtype") = "int64")
      .def(
          "read_into",
          [](Store& s, const std::string& uid, py::array out, size_t dst_row, size_t t0,
             size_t t1) {
            require_c_contiguous(out, "out");
            if (out.ndim() != 3 || out.shape(0) != s.num_layers() || out.shape(2) != s.top_k())
              throw py::value_error("out must have shape [layers, rows, top_k]");
            const size_t rows = size_t(out.shape(1));
            const bool i64 = is_int64_out(out);
            void* o = out.mutable_data();
            py::gil_scoped_release nogil;
            if (i64)
              s.read(uid, static_cast<int64_t*>(o), t0, t1, true, rows, dst_row);
            else
              s.read(uid, static_cast<int32_t*>(o), t0, t1, true, rows, dst_row);
          },
          py::arg("uid"), py::arg("out"), py::arg("dst_row"), py::arg("t0"), py::arg("t1"),
          "Decode tokens [t0, t1) of a record into rows dst_row.. of out [layers, rows, top_k].")
      .def(
          "info",
          [](Store& s, const std::string& uid) {
            RecordInfo i = s.info(uid);
            py::dict d;
            d["seq"] = i.seq;
            d["segment"] = i.segment;
            d["offset"] = i.offset;
            d["num_tokens"] = i.num_tokens;
            d["versions"] = py::tuple(py::cast(i.versions));
            return d;
          },
          py::arg("uid"))
      .def("num_tokens", [](Store& s, const std::string& uid) { return s.info(uid).num_tokens; })
      .def("__contains__", &Store::contains)
      .def("__len__", &Store::size)
      .def("uids", &Store::uids)
      .def("refresh", &Store::refresh, py::call_guard<py::gil_scoped_release>())
      .def("sync", &Store::sync, py::call_guard<py::gil_scoped_release>())
      .def("close", &Store::close, py::call_guard<py::gil_scoped_release>())
      .def("segment_path", &Store::segment_path)
      .def("stats", [](Store& s) {
        StoreStats st = s.stats();
        py::dict d;
        d["records"] = st.records;
        d["tokens"] = st.tokens;
        d["payload_bytes"] = st.payload_bytes;
        d["record_bytes"] = st.record_bytes;
        d["index_bytes"] = st.index_bytes;
        d["segments"] = st.segments;
        return d;
      });
}
