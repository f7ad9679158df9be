// Calls the kernels' C++ shape inference (<Kernel>InferShape, custom_aot/infer_shape.cc) as
// MindSpore does, for tests/test_infer_shape.py, which compares it with the Python declarations.
//
//   infer_shapes LIBRARY < calls
//
// One call per input line, tab-separated: the kernel symbol; its number of outputs (one: the
// function returns a shape, more: a vector of them); its attributes as name=kind:value (kind i,
// f, b or s) separated by commas; then one shape per present input, dimensions separated by
// commas ("" for a 0-d shape). The answer is one line: the output shapes separated by tabs.
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "aot_call.h"

namespace {

using Shape = std::vector<int64_t>;

std::vector<std::string> split(const std::string &text, char sep) {
  std::vector<std::string> parts;
  std::string part;
  std::istringstream in(text);
  while (std::getline(in, part, sep)) parts.push_back(part);
  if (!text.empty() && text.back() == sep) parts.push_back("");
  return parts;
}

Shape parse_shape(const std::string &text) {
  Shape shape;
  for (const auto &d : split(text, ',')) {
    if (!d.empty()) shape.push_back(std::stoll(d));
  }
  return shape;
}

void set_attr(harness::Attrs &attrs, const std::string &item) {
  const auto eq = item.find('='), colon = item.find(':');
  const std::string name = item.substr(0, eq), kind = item.substr(eq + 1, colon - eq - 1),
                    value = item.substr(colon + 1);
  if (kind == "i") attrs.set_int(name, std::stoll(value));
  else if (kind == "f") attrs.set_float(name, std::stof(value));
  else if (kind == "b") attrs.set_bool(name, value == "1");
  else attrs.set_str(name, value);
}

std::string join(const Shape &shape) {
  std::string out;
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? "," : "") + std::to_string(shape[i]);
  return out;
}

}  // namespace

int main(int argc, char **argv) {
  if (argc != 2) {
    std::cerr << "usage: infer_shapes LIBRARY < calls\n";
    return 2;
  }
  harness::Library lib(argv[1]);
  std::string line;
  while (std::getline(std::cin, line)) {
    const auto fields = split(line, '\t');
    harness::Attrs attrs;
    for (const auto &item : split(fields[2], ',')) {
      if (!item.empty()) set_attr(attrs, item);
    }
    std::vector<Shape> shapes;
    for (size_t i = 3; i < fields.size(); ++i) shapes.push_back(parse_shape(fields[i]));
    std::vector<int> ndims;
    std::vector<int64_t *> data;
    for (auto &s : shapes) {
      ndims.push_back(static_cast<int>(s.size()));
      data.push_back(s.data());
    }
    const std::string name = fields[0] + "InferShape";
    // the single-output kernels return one shape, the others a vector of them
    using One = Shape (*)(int *, int64_t **, void *);
    using Many = std::vector<Shape> (*)(int *, int64_t **, void *);
    void *fn = lib.symbol(name);
    if (!fn) {
      std::cerr << "infer_shapes: the library exports no " << name << "\n";
      return 2;
    }
    std::vector<Shape> outs;
    if (std::stoi(fields[1]) > 1) {
      outs = reinterpret_cast<Many>(fn)(ndims.data(), data.data(), &attrs);
    } else {
      outs = {reinterpret_cast<One>(fn)(ndims.data(), data.data(), &attrs)};
    }
    for (size_t i = 0; i < outs.size(); ++i) std::cout << (i ? "\t" : "") << join(outs[i]);
    std::cout << std::endl;
  }
  return 0;
}
