// Order statistics of measurements.
#ifndef HAP_COMMON_STATS_H_
#define HAP_COMMON_STATS_H_

#include <algorithm>
#include <vector>

namespace hap {

// The median of `v`: its middle value, or the mean of the two middle values
// when it has an even count; 0 for none.
inline double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  const size_t n = v.size();
  std::nth_element(v.begin(), v.begin() + n / 2, v.end());
  const double upper = v[n / 2];
  if (n % 2) return upper;
  return 0.5 * (*std::max_element(v.begin(), v.begin() + n / 2) + upper);
}

// The upper median of `v`: its value at index size / 2 in order, always one
// that was measured (the middle one, or the larger of the two middle ones);
// 0 for none.
inline double UpperMedian(std::vector<double> v) {
  if (v.empty()) return 0;
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

}  // namespace hap

#endif  // HAP_COMMON_STATS_H_
